"""The controller's durable state in etcd (v3): the same methods and rules as the SQLite
:class:`.sqlite.state.ControllerState`, for a control plane that outlives its machine.

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

Every durable change is one method and one transaction, which loads records and applies
what a rule of :mod:`.rules` decides (the SQLite store applies the same rules). Regions
and replica sets are here; batched creates in :mod:`.etcd.create`, memory servers in
:mod:`.etcd.servers`, owner leases in :mod:`.etcd.leases`, leadership and barriers'
generations in :mod:`.etcd.leadership`; the keys, snapshots, fenced commits and retries
they are written with in :mod:`.etcd.txn`.
"""
from __future__ import annotations

import json
import logging
import secrets
from dataclasses import replace

from ...records import (
    CreateRequest,
    DeletedRegion,
    ExtentRecord,
    RegionRecord,
    SlotChange,
    check_create,
    check_request_id,
    region_state,
)
from ...rules import (
    abortable,
    check_committable,
    check_created,
    check_settings,
    delete_memory_horizon,
    retried_delete,
    slot_change,
)
from . import kv
from .create import FIRST_ID_BASE, RegionCreates
from .leadership import EtcdLeadership
from .leases import EtcdLeases
from .servers import EtcdServers
from .txn import _extent_row

log = logging.getLogger(__name__)


class EtcdState(RegionCreates, EtcdLeadership, EtcdServers, EtcdLeases):
    """Servers, regions and extents in etcd; owns its etcd channel.

    ``url``: ``etcd://host:port[,host:port...][/prefix]``. ``lease_seconds`` and
    ``orphan_grace_seconds`` as for :class:`.sqlite.state.ControllerState`. ``recover``: remove
    regions left ``creating`` by a controller that died (only the leader may: a standby
    passes False and calls :meth:`take_over` once it leads).
    """

    def __init__(self, url: str, lease_seconds: float = 5.0, orphan_grace_seconds: float = 30.0,
                 recover: bool = True, timeout: float = kv.REQUEST_TIMEOUT) -> None:
        lease_seconds, orphan_grace_seconds = check_settings(lease_seconds, orphan_grace_seconds)
        super().__init__(url, timeout)
        self.lease_seconds, self.orphan_grace_seconds = lease_seconds, orphan_grace_seconds
        if recover:
            self.recover()

    def __enter__(self) -> EtcdState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- regions -------------------------------------------------------------------------
    def begin_create_region(self, request: CreateRequest, now: float | None = None) -> RegionRecord:
        """Plan a region and record it as ``creating`` (as
        :meth:`.sqlite.state.ControllerState.begin_create_region`)."""
        req = check_create(request)
        region = self._creates.run((req, self._now(now)))
        log.info("planned region %s (%s, %d bytes) on %d extent(s)", req.name, region.placement,
                 region.size, len(region.extents))
        return region

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
            check_committable(name, row["uid"] if row else None, uid)
            assert row is not None
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
            if row is None or not abortable(row["state"], row["uid"], uid):
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
        check_created(name, found[0]["state"] if found else None)
        assert found is not None
        return snap.region(found[0])

    def delete_region(self, name: str, request_id: str = "", now: float | None = None) -> list[ExtentRecord]:
        """Remove a ready region; returns its extents, which the caller releases (as
        :meth:`.sqlite.state.ControllerState.delete_region`)."""
        request_id, now = check_request_id(request_id), self._now(now)
        done = self._key("done_deletes", "")

        def attempt() -> RegionRecord | None:
            snap = self._snapshot(region_prefix=name)
            found = snap.regions.get(name)
            check_created(name, found[0]["state"] if found else None)
            assert found is not None
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
        :meth:`.sqlite.state.ControllerState.change_slot`): compares on the region's key and,
        for a new copy, on the extent id counter; writes the region, the ``placed`` index
        of added and removed copies and drops removed copies' ``lost`` keys."""
        def attempt() -> tuple[tuple[RegionRecord, list[ExtentRecord]] | None] | None:
            snap = self._snapshot(region_prefix=name, extra=(self.next_id_key,))
            found = snap.regions.get(name)
            check_created(name, found[0]["state"] if found else None, found[0]["uid"] if found else None, uid)
            assert found is not None
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

    def deleted_by(self, name: str, request_id: str) -> DeletedRegion | None:
        """What the delete of ``request_id`` removed when it removed region ``name``
        lately, else None (as :meth:`.sqlite.state.ControllerState.deleted_by`)."""
        if not request_id:
            return None
        (kvs,) = self.kv.read(kv.get_prefix(self._key("done_deletes", "")))
        record = next((item.value.decode() for item in kvs if item.key.endswith("/" + request_id)), None)
        return None if record is None else retried_delete(name, record)

    def list_regions(self, prefix: str = "") -> list[RegionRecord]:
        """Ready regions whose name starts with ``prefix``, by name."""
        snap = self._snapshot(region_prefix=prefix)
        return [snap.region(row) for name, (row, _) in sorted(snap.regions.items())
                if row["state"] == "ready" and name.startswith(prefix)]


