"""The controller's durable state: memory servers, regions and their extents.

Pure state over one SQLite file (WAL journal, ``synchronous=NORMAL``, foreign keys on):
no gRPC, no sockets, no threads of its own. The servicer in :mod:`.service` translates
messages into calls here; tests drive it directly with a fake clock (every method that
depends on time takes ``now``, unix seconds, defaulting to :func:`time.time`).

Every durable change the controller makes is one method and one SQLite transaction,
which loads records and applies what a rule of :mod:`.rules` decides, so that a reader
can check that nothing a successor needs lives outside a transaction. Regions and
replica sets are here; memory servers in :mod:`.sqlite.servers`, owner leases in
:mod:`.sqlite.leases`; the tables, the connection and the reads of rows into records in
:mod:`.sqlite.db`; records and input checks in :mod:`.records`. Region state as
reported to clients: :func:`.records.region_state`.

Thread safety: one connection guarded by one lock; every method is atomic.
"""
from __future__ import annotations

import json
import logging

from ...records import (
    CreateRequest,
    DeletedRegion,
    ExtentRecord,
    HeldExtent,
    RegionRecord,
    ServerRecord,
    SlotChange,
    check_create,
    check_request_id,
)
from ...rules import (
    abortable,
    check_committable,
    check_created,
    check_new_region,
    check_settings,
    delete_memory_horizon,
    half_created,
    plan_region,
    report_half_created,
    retried_delete,
    slot_change,
)
from .db import SqliteDb, load_region, new_extent_id, server_records
from .leases import OwnerLeases
from .servers import ServerRows

__all__ = ["ControllerState", "ExtentRecord", "HeldExtent", "RegionRecord",
           "ServerRecord"]

log = logging.getLogger(__name__)


# -- the state -----------------------------------------------------------------------------
class ControllerState(ServerRows, OwnerLeases):
    """Servers, regions and extents in one SQLite database; owns its connection.

    ``path`` is a file (created when missing) or ``":memory:"``. ``lease_seconds``: a
    server whose last heartbeat is older than this is marked down by
    :meth:`expire_leases` and gets no new extents. ``orphan_grace_seconds``: an extent a
    server holds but the database does not know is reported as an orphan once the
    server has held it this long (a create in flight is never an orphan: its rows exist
    before any server reserves anything).
    """

    def __init__(self, path: str, lease_seconds: float = 5.0,
                 orphan_grace_seconds: float = 30.0) -> None:
        self.lease_seconds, self.orphan_grace_seconds = check_settings(lease_seconds, orphan_grace_seconds)
        self.path = path
        self._sql = SqliteDb(path)
        try:
            self._forget_half_created()
        except BaseException:
            self._sql.close()
            raise

    def _forget_half_created(self) -> None:
        """Rows still ``creating`` belong to a controller that died mid-create: remove
        them; the extents the servers did reserve become orphans they free."""
        with self._sql.tx() as db:
            stale = half_created({r["name"]: r["state"] for r in db.execute("SELECT name, state FROM regions")})
            db.executemany("DELETE FROM regions WHERE name=?", [(name,) for name in stale])
        report_half_created(stale)

    @property
    def leadership(self) -> None:
        """None: a SQLite file has one controller, which always leads."""
        return None

    def close(self) -> None:
        """Close the database (idempotent)."""
        self._sql.close()

    def __enter__(self) -> ControllerState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- regions -------------------------------------------------------------------------
    def begin_create_region(self, request: CreateRequest, now: float | None = None) -> RegionRecord:
        """Plan a region and record it as ``creating``; returns it with its extents.

        Placement uses the servers that are ``up`` (not draining, lease not expired),
        each offering ``capacity - used`` bytes. The caller reserves the extents on the
        servers, then calls :meth:`commit_region` or :meth:`abort_region`. The request's
        ``uid``: the caller's uid for the region (see :func:`.records.check_uid`); "" draws
        one. ``replicas`` (1 to 3; 0 means 1): copies of every slot on distinct servers
        (:func:`smb_protocol.placement.plan_replicated`); copy 0 is the slot's primary,
        every copy starts at view 1. ``server_weights`` (layered only; server id ->
        weight): the segments go to those servers in proportion to their weights
        (:func:`smb_protocol.placement.plan`). Its ``owner`` and ``lease_seconds`` are the
        caller's (:meth:`lease_region`). Raises InvalidArgument (also for a uid another
        region has), RegionExists, or OutOfMemory (with the numbers).
        """
        now = self._now(now)
        req = check_create(request)
        name, uid, replicas = req.name, req.uid, req.replicas
        with self._sql.tx() as db:
            row = db.execute("SELECT state FROM regions WHERE name=?", (name,)).fetchone()
            check_new_region(req, row["state"] if row else None,
                             db.execute("SELECT 1 FROM regions WHERE uid=?", (uid,)).fetchone() is not None)
            layout, extents = plan_region(req, server_records(db), now, self.lease_seconds)
            db.execute(
                "INSERT INTO regions (name, uid, size, placement, stripe_unit, segment_sizes, "
                "segment_extents, persistent, created_at, state, replicas) "
                "VALUES (?,?,?,?,?,?,?,?,?,'creating',?)",
                (name, uid, layout.size, layout.kind, layout.stripe_unit,
                 json.dumps(list(layout.segment_sizes)), json.dumps(list(layout.segment_extents)),
                 int(req.persistent), now, replicas))
            for e in extents:
                db.execute("INSERT INTO extents (extent_id, region_name, idx, server_id, length, "
                           "copy, role, view) VALUES (?,?,?,?,?,?,?,?)",
                           (new_extent_id(db), name, e.index, e.server_id, e.length, e.copy, e.role, e.view))
            region = load_region(db, name)
        assert region is not None
        log.info("planned region %s (%s, %d bytes) on %d extent(s)", name, region.placement,
                 region.size, len(region.extents))
        return region

    def commit_region(self, name: str, uid: str | None = None) -> RegionRecord:
        """Mark a ``creating`` region ``ready`` (idempotent); raises RegionNotFound.

        With ``uid``, only that incarnation of the name is committed.
        """
        with self._sql.tx() as db:
            row = db.execute("SELECT uid FROM regions WHERE name=?", (name,)).fetchone()
            check_committable(name, row["uid"] if row else None, uid)
            db.execute("UPDATE regions SET state='ready' WHERE name=?", (name,))
            region = load_region(db, name)
        assert region is not None
        log.info("region %s (uid %s) ready", name, region.uid)
        return region

    def abort_region(self, name: str, uid: str | None = None) -> list[ExtentRecord]:
        """Forget a region still ``creating``; returns its extents (to release).

        Does nothing (returns ``[]``) when no such region is being created.
        """
        with self._sql.tx() as db:
            region = load_region(db, name)
            if region is None or not abortable(region.state, region.uid, uid):
                return []
            db.execute("DELETE FROM regions WHERE name=?", (name,))
        log.info("creation of region %s aborted", name)
        return list(region.extents)

    def get_region(self, name: str) -> RegionRecord:
        """A ready region (state ``ready`` or ``degraded``); raises RegionNotFound."""
        with self._sql.read() as db:
            region = load_region(db, name)
        check_created(name, region.state if region else None)
        assert region is not None
        return region

    def delete_region(self, name: str, request_id: str = "", now: float | None = None) -> list[ExtentRecord]:
        """Remove a ready region; returns its extents, which the caller releases.

        ``request_id`` (see :meth:`deleted_by`) is remembered for
        ``DELETE_MEMORY_SECONDS``. Raises RegionNotFound (also for a region still being
        created).
        """
        request_id, now = check_request_id(request_id), self._now(now)
        with self._sql.tx() as db:
            region = load_region(db, name)
            check_created(name, region.state if region else None)
            assert region is not None
            db.executemany("DELETE FROM lost_extents WHERE extent_id=?",
                           [(e.extent_id,) for e in region.extents])
            db.execute("DELETE FROM regions WHERE name=?", (name,))
            db.execute("DELETE FROM done_deletes WHERE deleted_at < ?", (delete_memory_horizon(now),))
            if request_id:
                db.execute("INSERT OR REPLACE INTO done_deletes (request_id, name, deleted_at, region) "
                           "VALUES (?,?,?,?)", (request_id, name, now, DeletedRegion.of(region).dump(name)))
        log.info("region %s (uid %s) deleted", name, region.uid)
        return list(region.extents)

    # -- replica sets ----------------------------------------------------------------------
    def change_slot(self, name: str, uid: str, change: SlotChange
                    ) -> tuple[RegionRecord, list[ExtentRecord]] | None:
        """Apply one change of one slot of a replicated region, atomically; returns the
        region after it and the copies it removed (the caller releases them), or None
        when the slot is no longer at ``change.view`` (another change won: decide again).

        A new copy gets a fresh extent id (never reused) on ``change.add.server_id``;
        every copy the slot keeps gets view ``change.view + 1``. Raises RegionNotFound
        when no ready region ``name`` of ``uid`` exists, InvalidArgument for a change
        that does not fit the slot (:func:`.records.check_slot_change`).
        """
        with self._sql.tx() as db:
            region = load_region(db, name)
            check_created(name, region.state if region else None, region.uid if region else None, uid)
            assert region is not None
            servers = [r[0] for r in db.execute("SELECT server_id FROM servers")]
            outcome = slot_change(region, change, servers, new_extent_id(db) if change.add else 0)
            if outcome is None:
                return None
            for e in outcome.removed:
                db.execute("DELETE FROM extents WHERE extent_id=?", (e.extent_id,))
                db.execute("DELETE FROM lost_extents WHERE extent_id=?", (e.extent_id,))
            db.executemany("UPDATE extents SET role=?, view=? WHERE extent_id=?",
                           [(e.role, e.view, e.extent_id) for e in outcome.kept])
            if (new := outcome.added) is not None:
                db.execute("INSERT INTO extents (extent_id, region_name, idx, server_id, length, "
                           "copy, role, view) VALUES (?,?,?,?,?,?,?,?)",
                           (new.extent_id, name, new.index, new.server_id, new.length, new.copy, new.role,
                            new.view))
            after = load_region(db, name)
        assert after is not None
        log.info("region %s %s", name, change.describe())
        return after, list(outcome.removed)

    def deleted_by(self, name: str, request_id: str) -> DeletedRegion | None:
        """What the delete of ``request_id`` removed when it removed region ``name``
        (within the last ``DELETE_MEMORY_SECONDS``), else None: a retry of it is answered
        as done, and releases the extents again."""
        if not request_id:
            return None
        with self._sql.read() as db:
            row = db.execute("SELECT name, region FROM done_deletes WHERE request_id=?",
                             (request_id,)).fetchone()
        return None if row is None else retried_delete(name, row["region"] or row["name"])

    def list_regions(self, prefix: str = "") -> list[RegionRecord]:
        """Ready regions whose name starts with ``prefix``, by name."""
        with self._sql.read() as db:
            names = [r["name"] for r in db.execute(
                "SELECT name FROM regions WHERE state='ready' AND substr(name, 1, ?) = ? ORDER BY name",
                (len(prefix), prefix))]
            regions = [load_region(db, n) for n in names]
        return [r for r in regions if r is not None]

