"""Memory servers in the etcd store (:class:`.etcd.state.EtcdState` builds on it):
registrations, heartbeats, lease expiry, drains and removals, each read and committed
with compares on the server's row (never under the region lock, so that heartbeats do
not queue behind region changes), applying what :mod:`.rules` and :mod:`.moves` decide."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from smb_protocol import errors

from ...moves import check_removable, drain_flag, removed_error
from ...records import HeldExtent, ServerRecord, find_orphans
from ...rules import check_registration, drained_state, find_server, lease_ran_out, live_state, lost_on_register
from . import kv
from .txn import EtcdStore

log = logging.getLogger(__name__)


class EtcdServers(EtcdStore):
    """The memory servers' keys ``P/servers/<id>`` (and ``P/removed/<id>``, ``P/lost/<extent>``)."""

    lease_seconds: float          # seconds a silent memory server stays up
    orphan_grace_seconds: float   # seconds before an unknown held extent is an orphan

    def register_server(self, server_id: str, host_id: str, grpc_address: str,
                        endpoints: Sequence[str], capacity: int,
                        held: Iterable[HeldExtent] = (), now: float | None = None
                        ) -> tuple[str, list[int]]:
        """Add or refresh a memory server; returns its id and the orphan extent ids (as
        :meth:`.sqlite.state.ControllerState.register_server`)."""
        now = self._now(now)
        server_id, capacity = check_registration(server_id, grpc_address, capacity)
        held = list(held)

        def attempt() -> tuple[str, list[int]] | None:
            if self._read_one("removed", server_id)[0] is not None:
                raise removed_error(server_id)
            snap = self._snapshot(lost=False)
            old = snap.servers.get(server_id)
            drain = int(old[0]["drain"]) if old is not None else 0   # the drain flag stays
            row = {"server_id": server_id, "host_id": host_id, "grpc_address": grpc_address,
                   "endpoints": list(endpoints), "capacity": int(capacity), "state": live_state(drain),
                   "drain": drain, "last_heartbeat": now, "registered_at": now}
            known = snap.known_extents(server_id)
            lost = lost_on_register(server_id, known, held)
            key = self._key("servers", server_id)
            ops = [kv.put(key, json.dumps(row))] + [kv.put(self._key("lost", eid), "") for eid in lost]
            removed = kv.mod_revision_is(self._key("removed", server_id), 0)   # not removed meanwhile
            if not self._commit([kv.mod_revision_is(key, old[1] if old else 0), removed], ops):
                return None
            if old is None:
                log.info("server %s registered at %s (%d bytes)", server_id, grpc_address, capacity)
            else:
                log.info("server %s registered again at %s (%d bytes, %s)", server_id,
                         grpc_address, capacity, row["state"])
            return server_id, find_orphans(server_id, known, held, self.orphan_grace_seconds)
        return self._retry(attempt, f"registering server {server_id}", regions=False)

    def heartbeat(self, server_id: str, held: Iterable[HeldExtent] = (),
                  now: float | None = None) -> list[int]:
        """Renew a server's lease; returns its orphan extent ids. Raises ServerNotFound."""
        now = self._now(now)
        held = list(held)

        def attempt() -> list[int] | None:
            server, placed = self.kv.read(kv.get(self._key("servers", server_id)),
                                          kv.get_prefix(self._key("placed", server_id, "")))
            if not server:
                raise errors.ServerNotFound(f"no memory server {server_id!r} is registered; register first")
            row, rev = server[0].json(), server[0].mod_revision
            state = live_state(row["drain"])
            if row["state"] == "down":
                log.info("server %s is back (%s)", server_id, state)
            key = self._key("servers", server_id)
            if not self._commit([kv.mod_revision_is(key, rev)],
                                [kv.put(key, json.dumps({**row, "state": state, "last_heartbeat": now}))]):
                return None
            known = {int(item.key.rpartition("/")[2]): (item.json()["uid"], "") for item in placed}
            return find_orphans(server_id, known, held, self.orphan_grace_seconds)
        return self._retry(attempt, f"heartbeat of server {server_id}", regions=False)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Mark servers whose lease ran out ``down``; returns the ids newly marked."""
        now = self._now(now)

        def attempt() -> list[str] | None:
            snap = self._snapshot(regions=False, lost=False)
            late = {sid: (row, rev) for sid, (row, rev) in snap.servers.items()
                    if lease_ran_out(row["state"], row["last_heartbeat"], now, self.lease_seconds)}
            if not self._commit_each(([kv.mod_revision_is(self._key("servers", sid), rev)],
                                      [kv.put(self._key("servers", sid), json.dumps({**row, "state": "down"}))])
                                     for sid, (row, rev) in late.items()):
                marked.update(late)  # some may be applied; the next read shows which are left
                return None
            return sorted(marked | set(late))
        marked: set[str] = set()
        ids = self._retry(attempt, "expiring leases", regions=False)
        for sid in ids:
            log.warning("server %s missed its lease (%.1f s): marked down", sid, self.lease_seconds)
        return ids

    def _update_server(self, server_id: str, change: Callable[[dict[str, Any]], dict[str, Any]],
                       missing: str) -> None:
        def attempt() -> bool | None:
            row, rev = self._read_one("servers", server_id)
            if row is None:
                raise errors.ServerNotFound(missing)
            key = self._key("servers", server_id)
            return True if self._commit([kv.mod_revision_is(key, rev)],
                                        [kv.put(key, json.dumps(change(row)))]) else None
        self._retry(attempt, f"updating server {server_id}", regions=False)

    def unregister(self, server_id: str, reason: str = "") -> ServerRecord:
        """A server stopping cleanly: mark it ``down`` now. Raises ServerNotFound."""
        self._update_server(server_id, lambda row: {**row, "state": "down"},
                            f"no memory server {server_id!r} is registered")
        log.info("server %s stopped%s: marked down", server_id, f" ({reason})" if reason else "")
        return self.get_server(server_id)

    def drain(self, server_id: str, undrain: bool = False, evacuate: bool = False) -> ServerRecord:
        """Stop (or resume) placing new extents on a server; ``evacuate``: move its
        copies away too. Raises ServerNotFound."""
        flag = drain_flag(undrain, evacuate)

        def change(row: dict[str, Any]) -> dict[str, Any]:
            return {**row, "drain": flag, "state": drained_state(row["state"], undrain)}
        self._update_server(server_id, change,
                            f"no memory server {server_id!r}; `smb status` lists the ids")
        log.info("server %s %s", server_id, "undrained" if undrain else "evacuating" if evacuate else "draining")
        return self.get_server(server_id)

    def remove_server(self, server_id: str) -> ServerRecord:
        """Forget a drained server that holds nothing (:func:`.records.check_removable`).
        Raises ServerNotFound, InvalidArgument."""
        def attempt() -> ServerRecord | None:
            server = next((s for s in self.list_servers() if s.server_id == server_id), None)
            row, rev = self._read_one("servers", server_id)
            if server is None or row is None:
                raise errors.ServerNotFound(f"no memory server {server_id!r}; `smb status` lists the ids")
            check_removable(server)
            key = self._key("servers", server_id)
            tombstone = kv.put(self._key("removed", server_id), json.dumps({"removed_at": self._now(None)}))
            return server if self._commit([kv.mod_revision_is(key, rev)], [kv.delete(key), tombstone]) else None
        server = self._retry(attempt, f"removing server {server_id}")
        log.info("server %s removed from the pool", server_id)
        return server

    def get_server(self, server_id: str) -> ServerRecord:
        """One server; raises ServerNotFound."""
        return find_server(self.list_servers(), server_id)

    def list_servers(self) -> list[ServerRecord]:
        """Every server ever registered, by id, with ``used`` computed from its extents."""
        return self._snapshot(lost=False).server_records()
