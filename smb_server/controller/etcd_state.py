"""The controller's durable state in etcd (v3): the same methods and rules as the SQLite
:class:`.state.ControllerState`, for a control plane that outlives its machine.

Keys under the store's prefix ``P`` (default ``/smb``), values JSON:

- ``P/servers/<server_id>``: one memory server (the columns of SQLite's ``servers``);
- ``P/regions/<name>``: one region with its extents, by (slot, copy): each
  ``[extent_id, slot, server_id, length, copy, role, view]`` (rows written before
  replication have the first four; the rest default to an unreplicated extent), and
  ``replicas`` (absent: 1);
- ``P/placed/<server_id>/<extent_id>``: an index of the extents placed on a server (its
  region's uid and name, its length), written and removed with the region, so that a
  heartbeat reads the server's own extents and not every region;
- ``P/lost/<extent_id>``: an extent its server registered without;
- ``P/next_extent_id``: the next extent id to hand out; ids are never reused (the first
  is drawn at random in [2^61, 2^62), so that a new store does not hand out the ids of
  orphans a former one left on the servers);
- ``P/done_deletes/<unix seconds, 12 digits>/<request_id>``: a done delete (the region's
  name), kept ``DELETE_MEMORY_SECONDS`` for its retries; time first, so that the old
  ones go with one range delete;
- ``P/barriers/<name>`` and ``P/barrier_arrivals/<name>``: how many times a controller
  barrier opened, and the arrival ids of its last opening (:mod:`.barriers`);
- ``P/epoch`` and ``P/leader``: the leader election (:mod:`.leader`).

Every change that SQLite makes in one transaction is one etcd transaction here. Each
method reads what it decides on, then commits with compares: the keys it rewrites are
unchanged since the read (``mod_revision``), the keys it creates are absent, and, once
this controller leads, the leader epoch is still its own (its fence). A change that
loses a race is decided again from a fresh read; a change refused by the fence raises
``ControllerUnavailable`` naming the leader, and nothing of it is applied.

Nothing is cached: every call reads etcd, so a standby that takes over starts from
exactly what the previous leader committed. Thread safety: one lock serializes this
process's region changes; server rows (registrations, heartbeats, leases, drains) are
changed under their compares alone, so that heartbeats never queue behind region changes.

Every durable change is one method and one transaction here, side by side with the
SQLite backend's, so that a reader can check the two keep the same rules; the keys,
snapshots, fenced commits and retries they are written with are in :mod:`.etcd_txn`.
"""
from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from smb_protocol import errors
from smb_protocol.placement import check_bytes

from . import etcd_kv as kv
from .etcd_create import FIRST_ID_BASE, RegionCreates
from .etcd_txn import MAX_TXN_OPS as MAX_TXN_OPS  # the limit callers check against
from .etcd_txn import Fence, _extent_row
from .leader import Election
from .moves import check_removable, drain_flag, removed_error
from .records import (
    DeletedRegion,
    ExtentRecord,
    HeldExtent,
    RegionRecord,
    ServerRecord,
    SlotChange,
    check_create,
    check_lease,
    check_request_id,
    find_orphans,
    region_state,
)
from .rules import (
    OwnerLease,
    delete_memory_horizon,
    drained_state,
    half_created,
    lapsed,
    lease_ran_out,
    leased,
    live_state,
    lost_on_register,
    refreshed_on_take_over,
    renewed,
    report_half_created,
    retried_delete,
    slot_change,
)

log = logging.getLogger(__name__)


class EtcdState(RegionCreates):
    """Servers, regions and extents in etcd; owns its etcd channel.

    ``url``: ``etcd://host:port[,host:port...][/prefix]``. ``lease_seconds`` and
    ``orphan_grace_seconds`` as for :class:`.state.ControllerState`. ``recover``: remove
    regions left ``creating`` by a controller that died (only the leader may: a standby
    passes False and calls :meth:`take_over` once it leads).
    """

    def __init__(self, url: str, lease_seconds: float = 5.0, orphan_grace_seconds: float = 30.0,
                 recover: bool = True, timeout: float = kv.REQUEST_TIMEOUT) -> None:
        if lease_seconds <= 0:
            raise errors.InvalidArgument(f"lease must be positive, got {lease_seconds} seconds")
        if orphan_grace_seconds < 0:
            raise errors.InvalidArgument(f"orphan grace must not be negative, got {orphan_grace_seconds}")
        super().__init__(url, timeout)
        self.lease_seconds = float(lease_seconds)
        self.orphan_grace_seconds = float(orphan_grace_seconds)
        if recover:
            self.recover()

    def __enter__(self) -> EtcdState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


    # -- leadership (:class:`.store.Leadership`) --------------------------------------------
    @property
    def leadership(self) -> EtcdState:
        """This store: its controllers elect a leader."""
        return self

    def stand_by(self) -> None:
        """Refuse every write until :meth:`take_over`."""
        self.fenced = True

    def election(self, address: str, lease_seconds: float) -> Election:
        """This controller's part in the election, on this store's etcd channel."""
        return Election(self.kv, self.prefix, address, lease_seconds)

    def step_down(self) -> None:
        """Stop leading: writes are refused until the next :meth:`take_over`."""
        self.fence = None

    def recover(self) -> list[str]:
        """Remove regions left ``creating`` by a controller that died; returns their names.

        The extents their servers reserved become orphans the servers free after the grace.
        """
        def attempt() -> list[str] | None:
            snap = self._snapshot(servers=False, lost=False)
            stale = half_created({n: row["state"] for n, (row, _) in snap.regions.items()})
            if not self._commit_each(([kv.mod_revision_is(self._key("regions", n), snap.regions[n][1])],
                                       self._removal(snap.regions[n][0])) for n in stale):
                return None
            return stale
        stale = self._retry(attempt, "removing half-created regions")
        report_half_created(stale)
        return stale

    def take_over(self, fence: Fence, now: float | None = None) -> None:
        """Start leading with ``fence``: clean what a dead leader left half-done, and give
        every live server a full lease to find this controller.

        Region changes wait until it is done (it holds the region lock): a create begun
        now must not be taken for one the dead leader left half-done.
        """
        with self._lock:
            self.fence = fence
            self.recover()
            self._reindex()
        now = self._now(now)

        def attempt() -> bool | None:
            snap = self._snapshot(regions=False, lost=False)
            live = {sid: (row, rev) for sid, (row, rev) in snap.servers.items()
                    if refreshed_on_take_over(row["state"], row["last_heartbeat"], now)}
            return True if self._commit_each(
                ([kv.mod_revision_is(self._key("servers", sid), rev)],
                 [kv.put(self._key("servers", sid), json.dumps({**row, "last_heartbeat": now}))])
                for sid, (row, rev) in live.items()) else None
        self._retry(attempt, "taking over")
        log.info("leading with epoch %d", fence.epoch)

    def _reindex(self) -> None:
        """Make the ``placed`` index match the regions (a store written before the index,
        or by hand): add missing entries, drop entries of no region."""
        def attempt() -> bool | None:
            snap_regions, placed = self.kv.read(kv.get_prefix(self._key("regions", "")),
                                                kv.get_prefix(self._key("placed", "")))
            want = {self._key("placed", sid, eid): json.dumps({"uid": r["uid"], "name": r["name"],
                                                               "length": length})
                    for r in (item.json() for item in snap_regions)
                    for eid, _, sid, length, *_ in r["extents"]}
            have = {item.key: item for item in placed}
            ops = [kv.put(k, v) for k, v in want.items() if k not in have or have[k].value.decode() != v]
            ops += [kv.delete(k) for k in have if k not in want]
            if not ops:
                return True
            log.warning("repairing the placed-extent index: %d entr%s", len(ops), "y" if len(ops) == 1 else "ies")
            # no compares: only this leader writes (its fence is checked), under its lock
            return True if self._commit_each(([], [op]) for op in ops) else None
        self._retry(attempt, "repairing the placed-extent index")

    # -- servers -------------------------------------------------------------------------
    def register_server(self, server_id: str, host_id: str, grpc_address: str,
                        endpoints: Sequence[str], capacity: int,
                        held: Iterable[HeldExtent] = (), now: float | None = None
                        ) -> tuple[str, list[int]]:
        """Add or refresh a memory server; returns its id and the orphan extent ids (as
        :meth:`.state.ControllerState.register_server`)."""
        now = self._now(now)
        if not grpc_address:
            raise errors.InvalidArgument("a memory server must give its gRPC address")
        capacity = check_bytes("capacity", capacity)
        server_id = server_id or uuid.uuid4().hex[:12]
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
                            f"no memory server {server_id!r}; see ListServers for the ids")
        log.info("server %s %s", server_id, "undrained" if undrain else "evacuating" if evacuate else "draining")
        return self.get_server(server_id)

    def remove_server(self, server_id: str) -> ServerRecord:
        """Forget a drained server that holds nothing (:func:`.records.check_removable`).
        Raises ServerNotFound, InvalidArgument."""
        def attempt() -> ServerRecord | None:
            server = next((s for s in self.list_servers() if s.server_id == server_id), None)
            row, rev = self._read_one("servers", server_id)
            if server is None or row is None:
                raise errors.ServerNotFound(f"no memory server {server_id!r}; see ListServers for the ids")
            check_removable(server)
            key = self._key("servers", server_id)
            tombstone = kv.put(self._key("removed", server_id), json.dumps({"removed_at": self._now(None)}))
            return server if self._commit([kv.mod_revision_is(key, rev)], [kv.delete(key), tombstone]) else None
        server = self._retry(attempt, f"removing server {server_id}")
        log.info("server %s removed from the pool", server_id)
        return server

    def get_server(self, server_id: str) -> ServerRecord:
        """One server; raises ServerNotFound."""
        for s in self.list_servers():
            if s.server_id == server_id:
                return s
        raise errors.ServerNotFound(f"no memory server {server_id!r}")

    def list_servers(self) -> list[ServerRecord]:
        """Every server ever registered, by id, with ``used`` computed from its extents."""
        return self._snapshot(lost=False).server_records()

    # -- regions -------------------------------------------------------------------------
    def begin_create_region(self, name: str, size: int, placement: str = "striped",
                            stripe_unit: int = 0, num_servers: int = 0,
                            segment_sizes: Sequence[int] = (), persistent: bool = False,
                            now: float | None = None, uid: str = "", replicas: int = 1,
                            server_weights: Mapping[str, float] | None = None
                            ) -> RegionRecord:
        """Plan a region and record it as ``creating`` (as
        :meth:`.state.ControllerState.begin_create_region`)."""
        req = check_create(name, size, placement, stripe_unit, num_servers, segment_sizes, persistent,
                           uid, replicas, server_weights)
        region = self._creates.run((req, self._now(now)))
        log.info("planned region %s (%s, %d bytes) on %d extent(s)", name, region.placement,
                 region.size, len(region.extents))
        return region

    def _removal(self, row: dict[str, Any]) -> list[kv.Op]:
        """The ops that remove a region: its key and its extents' index keys."""
        return [kv.delete(self._key("regions", row["name"])), kv.delete(self._key("region_leases", row["name"]))] + [
            kv.delete(self._key("placed", sid, eid)) for eid, _, sid, *_ in row["extents"]]

    def commit_region(self, name: str, uid: str | None = None) -> RegionRecord:
        """Mark a ``creating`` region ``ready`` (idempotent); raises RegionNotFound.

        A region this controller began is committed in one transaction, without a read:
        the compare on its key's revision says it is still what was written then.
        Commits, aborts and deletes do not take the region lock: their compares on the
        region's key are all they decide on (a placement only sees less free space).
        """
        begun = self._begun.pop(name)
        if begun is not None and (uid is None or begun.row["uid"] == uid):
            key = self._key("regions", name)
            row = {**begun.row, "state": "ready"}
            if self._commit([kv.mod_revision_is(key, begun.revision)], [kv.put(key, json.dumps(row))]):
                region = replace(begun.region, state=region_state("ready", begun.region.extents,
                                                                   begun.region.replicas))
                log.info("region %s (uid %s) ready", name, region.uid)
                return region

        def attempt() -> RegionRecord | None:
            snap = self._snapshot(region_prefix=name)
            row, rev = snap.regions.get(name, (None, 0))
            if row is None or (uid is not None and row["uid"] != uid):
                raise errors.RegionNotFound(f"region {name!r} was removed while it was being created")
            key = self._key("regions", name)
            row = {**row, "state": "ready"}
            if not self._commit([kv.mod_revision_is(key, rev)], [kv.put(key, json.dumps(row))]):
                return None
            return snap.region(row)
        region = self._retry(attempt, f"committing region {name}", regions=False)
        log.info("region %s (uid %s) ready", name, region.uid)
        return region

    def abort_region(self, name: str, uid: str | None = None) -> list[ExtentRecord]:
        """Forget a region still ``creating``; returns its extents (``[]`` when none is)."""
        def attempt() -> list[ExtentRecord] | None:
            row, rev = self._read_one("regions", name)
            if row is None or row["state"] != "creating" or (uid is not None and row["uid"] != uid):
                return []
            if not self._commit([kv.mod_revision_is(self._key("regions", name), rev)], self._removal(row)):
                return None
            log.info("creation of region %s aborted", name)
            return list(self._snapshot(regions=False).region(row).extents)
        self._begun.pop(name)
        return self._retry(attempt, f"aborting region {name}", regions=False)

    def get_region(self, name: str) -> RegionRecord:
        """A ready region (state ``ready``, ``degraded`` or ``lost``); raises RegionNotFound."""
        snap = self._snapshot(region_prefix=name)
        found = snap.regions.get(name)
        if found is None or found[0]["state"] == "creating":
            raise errors.RegionNotFound(f"no region named {name!r}")
        return snap.region(found[0])

    def delete_region(self, name: str, request_id: str = "", now: float | None = None) -> list[ExtentRecord]:
        """Remove a ready region; returns its extents, which the caller releases (as
        :meth:`.state.ControllerState.delete_region`)."""
        request_id, now = check_request_id(request_id), self._now(now)
        done = self._key("done_deletes", "")

        def attempt() -> RegionRecord | None:
            snap = self._snapshot(region_prefix=name)
            found = snap.regions.get(name)
            if found is None or found[0]["state"] == "creating":
                raise errors.RegionNotFound(f"no region named {name!r}")
            row, rev = found
            ops = self._removal(row)
            ops += [kv.delete(self._key("lost", e[0])) for e in row["extents"] if e[0] in snap.lost]
            ops.append(kv.delete_range(done, done + f"{int(delete_memory_horizon(now)):012d}"))
            if request_id:
                ops.append(kv.put(done + f"{int(now):012d}/{request_id}",
                                  DeletedRegion.of(snap.region(row)).dump(name)))
            if not self._commit([kv.mod_revision_is(self._key("regions", name), rev)], ops):
                return None
            return snap.region(row)
        region = self._retry(attempt, f"deleting region {name}", regions=False)
        log.info("region %s (uid %s) deleted", name, region.uid)
        return list(region.extents)

    # -- replica sets ----------------------------------------------------------------------
    def change_slot(self, name: str, uid: str, change: SlotChange
                    ) -> tuple[RegionRecord, list[ExtentRecord]] | None:
        """Apply one change of one slot of a replicated region in one transaction (as
        :meth:`.state.ControllerState.change_slot`): compares on the region's key and,
        for a new copy, on the extent id counter; writes the region, the ``placed`` index
        of added and removed copies and drops removed copies' ``lost`` keys."""
        def attempt() -> tuple[tuple[RegionRecord, list[ExtentRecord]] | None] | None:
            snap = self._snapshot(region_prefix=name, extra=(self.next_id_key,))
            found = snap.regions.get(name)
            if found is None or found[0]["uid"] != uid or found[0]["state"] == "creating":
                raise errors.RegionNotFound(f"no region named {name!r} (uid {uid})")
            row, rev = found
            counter = snap.extra[self.next_id_key]
            eid = int(counter.value) if counter is not None else FIRST_ID_BASE + secrets.randbits(61)
            outcome = slot_change(snap.region(row), change, snap.servers, eid)
            if outcome is None:
                return (None,)
            key = self._key("regions", name)
            compare = [kv.mod_revision_is(key, rev)]
            ops: list[kv.Op] = []
            for e in outcome.removed:
                ops += [kv.delete(self._key("placed", e.server_id, e.extent_id)),
                        kv.delete(self._key("lost", e.extent_id))]
            if (new := outcome.added) is not None:
                compare.append(kv.mod_revision_is(self.next_id_key, counter.mod_revision if counter else 0))
                ops.append(kv.put(self.next_id_key, str(new.extent_id + 1)))
                ops.append(kv.put(self._key("placed", new.server_id, new.extent_id),
                                  json.dumps({"uid": uid, "name": name, "length": new.length})))
            extents = [list(x) for x in map(_extent_row, row["extents"]) if x[1] != change.index]
            extents += [[e.extent_id, e.index, e.server_id, e.length, e.copy, e.role, e.view] for e in outcome.slot]
            new_row = {**row, "extents": sorted(extents, key=lambda x: (x[1], x[4]))}
            ops.append(kv.put(key, json.dumps(new_row)))
            if not self._commit(compare, ops):
                return None
            snap.lost -= {e.extent_id for e in outcome.removed}
            return ((snap.region(new_row), list(outcome.removed)),)
        (result,) = self._retry(attempt, f"changing slot {change.index} of region {name}")
        if result is not None:
            log.info("region %s %s", name, change.describe())
        return result

    # -- owner leases (as :class:`.state.ControllerState`'s) --------------------------------
    def lease_region(self, name: str, owner: str, seconds: float, now: float | None = None) -> None:
        """Tie region ``name`` to ``owner``'s lease of ``seconds`` (one transaction)."""
        owner, seconds, now = check_lease(owner, seconds), float(seconds), self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> bool | None:
            row, rev = self._read_one("owner_leases", owner)
            lease = leased(OwnerLease(**row) if row else None, seconds, now)
            compare = [kv.mod_revision_is(key, rev) if row else kv.absent(key)]
            ops = [kv.put(self._key("region_leases", name), owner), kv.put(key, json.dumps(asdict(lease)))]
            return True if self._commit(compare, ops) else None
        self._retry(attempt, f"leasing region {name}", regions=False)

    def renew_lease(self, owner: str, now: float | None = None) -> int:
        """Renew ``owner``'s lease; how many regions it holds (0: none, or run out)."""
        now = self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> int | None:
            row, rev = self._read_one("owner_leases", owner)
            lease = renewed(OwnerLease(**row) if row else None, now)
            if lease is None:
                return 0
            (leases,) = self.kv.read(kv.get_prefix(self._key("region_leases", "")))
            held = sum(1 for item in leases if item.value.decode() == owner)
            return held if self._commit([kv.mod_revision_is(key, rev)],
                                        [kv.put(key, json.dumps(asdict(lease)))]) else None
        return self._retry(attempt, f"renewing the lease of {owner}", regions=False)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ready regions whose owner's lease ran out, by name; forgets owners that hold
        no region any more."""
        now = self._now(now)
        owners_prefix, leases_prefix = self._key("owner_leases", ""), self._key("region_leases", "")
        owners, leases, regions = self.kv.read(kv.get_prefix(owners_prefix), kv.get_prefix(leases_prefix),
                                               kv.get_prefix(self._key("regions", "")))
        revisions = {item.key[len(owners_prefix):]: item.mod_revision for item in owners}
        expired, idle = lapsed({item.key[len(owners_prefix):]: OwnerLease(**item.json()) for item in owners},
                               {item.key[len(leases_prefix):]: item.value.decode() for item in leases},
                               [item.json()["name"] for item in regions if item.json()["state"] == "ready"], now)
        if idle:
            self._commit_each(([kv.mod_revision_is(self._key("owner_leases", o), revisions[o])],
                               [kv.delete(self._key("owner_leases", o))]) for o in idle)
        return expired

    def deleted_by(self, name: str, request_id: str) -> DeletedRegion | None:
        """What the delete of ``request_id`` removed when it removed region ``name``
        lately, else None (as :meth:`.state.ControllerState.deleted_by`)."""
        if not request_id:
            return None
        (kvs,) = self.kv.read(kv.get_prefix(self._key("done_deletes", "")))
        record = next((item.value.decode() for item in kvs if item.key.endswith("/" + request_id)), None)
        return None if record is None else retried_delete(name, record)

    # -- barriers' generations (:class:`.barriers.GenerationStore`) ---------------------------
    def barrier_generation(self, name: str) -> tuple[int, tuple[str, ...]]:
        """How many times barrier ``name`` has opened (0: never) and its last opening's
        arrival ids (``P/barriers/<name>`` and ``P/barrier_arrivals/<name>``)."""
        opened, arrivals = self.kv.read(kv.get(self._key("barriers", name)),
                                        kv.get(self._key("barrier_arrivals", name)))
        return (int(opened[0].value) if opened else 0), (tuple(arrivals[0].json()) if arrivals else ())

    def open_barrier(self, name: str, generation: int, arrivals: Sequence[str]) -> None:
        """Record the ``generation``-th opening of barrier ``name`` with its arrival ids
        (one fenced transaction that compares the generation before it)."""
        key = self._key("barriers", name)
        before = kv.value_is(key, str(generation - 1)) if generation > 1 else kv.absent(key)
        ops = [kv.put(key, str(generation)), kv.put(self._key("barrier_arrivals", name), json.dumps(list(arrivals)))]
        if not self._commit([before], ops):
            raise errors.ControllerUnavailable(f"barrier {name!r} opened elsewhere meanwhile; retry")

    def list_regions(self, prefix: str = "") -> list[RegionRecord]:
        """Ready regions whose name starts with ``prefix``, by name."""
        snap = self._snapshot(region_prefix=prefix)
        return [snap.region(row) for name, (row, _) in sorted(snap.regions.items())
                if row["state"] == "ready" and name.startswith(prefix)]


