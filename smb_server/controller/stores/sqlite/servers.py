"""Memory servers in the SQLite store (:class:`.sqlite.state.ControllerState` builds on it):
registrations, heartbeats, lease expiry, drains and removals, each one transaction that
applies what the rules of :mod:`.rules` and :mod:`.moves` decide."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence

from smb_protocol.errors import ServerNotFound

from ...moves import check_removable, drain_flag, removed_error
from ...records import HeldExtent, ServerRecord, find_orphans
from ...rules import check_registration, drained_state, find_server, lease_ran_out, live_state, lost_on_register
from .db import SqliteStore, known_extents, server_records

log = logging.getLogger(__name__)


class ServerRows(SqliteStore):
    """The memory servers' rows (see :class:`.sqlite.state.ControllerState` for the store)."""

    # -- servers -------------------------------------------------------------------------
    def register_server(self, server_id: str, host_id: str, grpc_address: str,
                        endpoints: Sequence[str], capacity: int,
                        held: Iterable[HeldExtent] = (), now: float | None = None
                        ) -> tuple[str, list[int]]:
        """Add or refresh a memory server; returns its id and the orphan extent ids.

        An empty ``server_id`` gets a generated one. A known server keeps its drain flag;
        it comes back ``up`` (or ``draining``). ``capacity`` is in bytes.
        """
        now = self._now(now)
        server_id, capacity = check_registration(server_id, grpc_address, capacity)
        held = list(held)
        with self._sql.tx() as db:
            if db.execute("SELECT 1 FROM removed_servers WHERE server_id=?", (server_id,)).fetchone():
                raise removed_error(server_id)
            row = db.execute("SELECT drain FROM servers WHERE server_id=?", (server_id,)).fetchone()
            endpoints_json = json.dumps(list(endpoints))
            if row is None:
                db.execute(
                    "INSERT INTO servers (server_id, host_id, grpc_address, endpoints, capacity, "
                    "state, drain, last_heartbeat, registered_at) VALUES (?,?,?,?,?,'up',0,?,?)",
                    (server_id, host_id, grpc_address, endpoints_json, int(capacity), now, now))
                log.info("server %s registered at %s (%d bytes)", server_id, grpc_address, capacity)
            else:
                state = live_state(row["drain"])
                db.execute(
                    "UPDATE servers SET host_id=?, grpc_address=?, endpoints=?, capacity=?, state=?, "
                    "last_heartbeat=?, registered_at=? WHERE server_id=?",
                    (host_id, grpc_address, endpoints_json, int(capacity), state, now, now, server_id))
                log.info("server %s registered again at %s (%d bytes, %s)", server_id,
                         grpc_address, capacity, state)
            known = known_extents(db, server_id)
            db.executemany("INSERT OR IGNORE INTO lost_extents (extent_id) VALUES (?)",
                           [(eid,) for eid in lost_on_register(server_id, known, held)])
            return server_id, self._orphans(server_id, known, held)

    def heartbeat(self, server_id: str, held: Iterable[HeldExtent] = (),
                  now: float | None = None) -> list[int]:
        """Renew a server's lease; returns the ids of its orphan extents.

        Orphans are held extents the database does not know (or knows on another server,
        or under another region uid) that the server has held for at least the grace
        period. Raises ServerNotFound for an unknown server (it should register again).
        """
        now = self._now(now)
        with self._sql.tx() as db:
            row = db.execute("SELECT state, drain FROM servers WHERE server_id=?",
                             (server_id,)).fetchone()
            if row is None:
                raise ServerNotFound(f"no memory server {server_id!r} is registered; register first")
            state = live_state(row["drain"])
            if row["state"] == "down":
                log.info("server %s is back (%s)", server_id, state)
            db.execute("UPDATE servers SET state=?, last_heartbeat=? WHERE server_id=?",
                       (state, now, server_id))
            return self._orphans(server_id, known_extents(db, server_id), held)

    def _orphans(self, server_id: str, known: dict[int, tuple[str, str]],
                 held: Iterable[HeldExtent]) -> list[int]:
        return find_orphans(server_id, known, held, self.orphan_grace_seconds)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Mark servers whose lease ran out ``down``; returns the ids newly marked."""
        now = self._now(now)
        with self._sql.tx() as db:
            ids = [r["server_id"] for r in db.execute(
                "SELECT server_id, state, last_heartbeat FROM servers ORDER BY server_id")
                if lease_ran_out(r["state"], r["last_heartbeat"], now, self.lease_seconds)]
            for sid in ids:
                db.execute("UPDATE servers SET state='down' WHERE server_id=?", (sid,))
        for sid in ids:
            log.warning("server %s missed its lease (%.1f s): marked down", sid, self.lease_seconds)
        return ids

    def unregister(self, server_id: str, reason: str = "") -> ServerRecord:
        """A server stopping cleanly: mark it ``down`` now, not after its lease.

        Its drain flag and its extents stay; a later registration brings it back
        ``up`` (or ``draining``). Raises ServerNotFound.
        """
        with self._sql.tx() as db:
            row = db.execute("SELECT state FROM servers WHERE server_id=?", (server_id,)).fetchone()
            if row is None:
                raise ServerNotFound(f"no memory server {server_id!r} is registered")
            db.execute("UPDATE servers SET state='down' WHERE server_id=?", (server_id,))
        log.info("server %s stopped%s: marked down", server_id, f" ({reason})" if reason else "")
        return self.get_server(server_id)

    def drain(self, server_id: str, undrain: bool = False, evacuate: bool = False) -> ServerRecord:
        """Stop (or, with ``undrain``, resume) placing new extents on a server; with
        ``evacuate`` its copies are also moved elsewhere (by the repair pass).

        Raises ServerNotFound.
        """
        flag = drain_flag(undrain, evacuate)
        with self._sql.tx() as db:
            row = db.execute("SELECT state FROM servers WHERE server_id=?", (server_id,)).fetchone()
            if row is None:
                raise ServerNotFound(f"no memory server {server_id!r}; `smb status` lists the ids")
            db.execute("UPDATE servers SET drain=?, state=? WHERE server_id=?",
                       (flag, drained_state(row["state"], undrain), server_id))
        log.info("server %s %s", server_id, "undrained" if undrain else "evacuating" if evacuate else "draining")
        return self.get_server(server_id)

    def remove_server(self, server_id: str) -> ServerRecord:
        """Forget a drained server that holds nothing (:func:`.records.check_removable`);
        returns its last record. Raises ServerNotFound, InvalidArgument."""
        with self._sql.tx() as db:
            server = next((s for s in server_records(db) if s.server_id == server_id), None)
            if server is None:
                raise ServerNotFound(f"no memory server {server_id!r}; `smb status` lists the ids")
            check_removable(server)
            db.execute("DELETE FROM servers WHERE server_id=?", (server_id,))
            db.execute("INSERT OR REPLACE INTO removed_servers (server_id, removed_at) VALUES (?,?)",
                       (server_id, time.time()))
        log.info("server %s removed from the pool", server_id)
        return server

    def get_server(self, server_id: str) -> ServerRecord:
        """One server; raises ServerNotFound."""
        return find_server(self.list_servers(), server_id)

    def list_servers(self) -> list[ServerRecord]:
        """Every server ever registered, by id, with ``used`` computed from its extents."""
        with self._sql.read() as db:
            return server_records(db)
