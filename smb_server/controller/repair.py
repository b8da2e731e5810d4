"""Repairing replicated regions: the controller keeps every slot's replica set in step
with its memory servers after a server dies, loses its memory or comes back.

The store holds what each slot should be (its copies, their roles and the slot's
``view``); a pass of :class:`RepairManager` compares that with the servers' states and
changes one slot at a time, each change one store transaction
(:meth:`.store.StateStore.change_slot`, view + 1) made durable *before* the
``ConfigureReplicas`` calls that depend on it. A pass, for every slot of every ready
replicated region:

1. **fence** (on the pass's own thread, quick calls only):
   - a primary on a down server, or one its server lost, with a live backup: that backup
     becomes the primary, the old primary ``stale``, the other live backups and syncing
     copies ``syncing`` (they may lag the new primary: each is copied whole again, step
     2), dead ones ``stale``. Then every live backup and syncing copy is configured as a
     backup at the new view (this fences the old primary: they refuse its older-view
     forwards), then the new primary (no backups yet);
   - with a live primary, a dead backup or syncing copy becomes ``stale``; then the
     primary is configured without it (its forwarding waits for that) and then the
     live backups;
   - copies on a server that registered again since the last pass (a restart: its
     replica settings are gone, its persistent data may be older) are treated as dead
     while the slot has an in-sync copy elsewhere: a returning server is reconciled,
     never trusted;
   - ``stale`` copies are dropped once the slot has ``replicas`` in-sync copies;
   - a backup or syncing copy its primary reported it cannot reach (with a heartbeat,
     :meth:`RepairManager.report`; a partition between two memory servers that both
     still heartbeat) becomes ``stale`` as a dead one does, and its server is avoided
     for ``AVOID_SECONDS``; trusted only from the slot's current primary at the slot's
     current view (a deposed primary's report changes nothing), handled before the
     other fencing of the pass (:func:`plan_report`);
   - a slot whose view this controller has not pushed yet (after a failed call, or
     after it started or took over) is configured again (same view: idempotent; a
     slot with a syncing copy is left to its sync; view 1 was configured by the create
     before its commit).
2. **sync** (on a thread pool, ``SYNC_WORKERS`` slots at once; a slot at a time): with
   a live primary and fewer than ``replicas`` in-sync copies, one copy is brought in:
   a ``syncing`` copy left by an earlier pass (re-driven at view + 1, so a server never
   takes a half-done sync for done), else a ``stale`` copy whose server is up and still
   holds it (resync), else a new copy with a fresh extent id on a spare server (up, not
   draining, no copy of the slot, enough free bytes; another host preferred, then the
   most free). The copy is recorded ``syncing``, reserved (idempotent), configured as a
   backup, then the primary is configured with it ``sync`` (the server copies the whole
   extent while clients keep writing); then it is recorded ``backup``, the ``stale``
   copies beyond ``replicas`` are dropped (their extents released, best effort: an
   unreachable server's becomes an orphan it frees when it returns) and the slot is
   configured at that view.

A **handover** (a moving primary replaced) and a rebalance's **role swap** (a backup made
the primary, the primary kept as a backup) are fencing changes too, made gracefully when
this controller configured the slot's current view itself: after the change is stored
(the staying copies ``syncing``), the old primary is configured a backup at the new view,
which drains its forwarding; then the copies that were in step are recorded backups again
(view + 1) and configured, the new primary last, so that nothing is copied. When the old
primary cannot be drained, the staying copies are synced from the new primary (step 2).

A failure anywhere leaves a state the next pass drives on from: views only grow, each
step is decided again from a fresh read, and a change decided on a view the slot has
left is refused by the store. A slot that failed waits ``RETRY_SECONDS``; a server that
could not take a copy is not picked for ``AVOID_SECONDS``. A slot without a live primary
and without a live backup waits (``degraded`` while a copy may come back, ``lost``
once none can).

No gRPC here: memory servers are reached through :class:`.memservers.MemoryServers`.

The decisions are pure functions in :mod:`.repair_plans`; the sequences that carry
them out are here, so that a reader checks the ordering rules (store before servers,
backups before a new primary) in one place.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures

from smb_protocol import errors
from smb_protocol.replicas import ReplicaRole

from .memservers import Backup, MemoryServers
from .moves import head_bytes, head_of, holds_all, leaving
from .rebalancer import Rebalancer
from .records import (
    ExtentRecord,
    FailedReplica,
    NewCopy,
    RegionRecord,
    ServerRecord,
    SlotChange,
)
from .repair_metrics import RepairMetrics as RepairMetrics  # the manager's, kept importable from here
from .repair_plans import SyncPlan, free_copy_number, plan_drained, plan_fence, plan_report, plan_sync
from .stores.protocol import StateStore

log = logging.getLogger(__name__)

#: Whether a handover or role swap drains the old primary and keeps the staying copies
#: without copying them again (one copy per moved primary). It was off while the elastic
#: benchmark found backups differing after drained handovers (two causes, fixed: a
#: re-synced copy's stale exactly-once entries, a piece of an older view applied on
#: copied bytes) and a client saw NotPrimary for good after a controller restart
#: mid-evacuation (a deposed primary's refused forward was finished with that refusal and
#: handed to the copy: it is resumable now, :class:`~smb_server.memserver.replication.Deposed`).
GRACEFUL_HANDOVER = True

REPAIR_INTERVAL = 1.0   # seconds between passes when nothing wakes the manager
SYNC_WORKERS = 4        # slots synced at once
RETRY_SECONDS = 5.0     # a slot whose repair failed waits this long
AVOID_SECONDS = 30.0    # a server that could not take a copy is not picked for this long

Key = tuple[str, int]   # (region uid, slot)


# -- the manager -------------------------------------------------------------------------
class RepairManager:
    """Drives replicated regions' slots back to full, in-step replica sets.

    Borrows ``state`` and ``servers`` (the caller closes them); owns a pool of
    ``sync_workers`` threads for syncs, shut down by :meth:`close`. :meth:`run_pass`
    is called from one thread at a time (the controller's repair thread, or a test);
    only a leader may call it (:meth:`reset` when leadership changes).
    """

    def __init__(self, state: StateStore, servers: MemoryServers, *,
                 metrics: RepairMetrics | None = None, sync_workers: int = SYNC_WORKERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.servers = servers
        self.metrics = metrics or RepairMetrics()
        self.moves = Rebalancer()
        #: evacuating server id -> (unix time this leader first saw it evacuate, bytes it held then)
        self.evacuations: dict[str, tuple[float, int]] = {}
        #: asks for the next pass now (the controller's repair thread): a copy in step
        #: may complete a move, which the next pass's fencing does
        self.wake: Callable[[], None] = lambda: None
        self.clock = clock
        self._pool = futures.ThreadPoolExecutor(sync_workers, thread_name_prefix="replica-sync")
        self._lock = threading.Lock()
        self._applied: dict[Key, int] = {}      # the view last pushed to a slot's servers
        self._promoting: set[Key] = set()       # slots whose promotion is not pushed yet
        self._in_flight: dict[Key, futures.Future[None]] = {}
        self._retry_at: dict[Key, float] = {}
        self._avoid: dict[str, float] = {}      # server id -> monotonic time it may be picked again
        self._registered: dict[str, float] = {}  # server id -> registered_at last seen
        self._warned: set[Key] = set()          # slots reported as short of a spare server
        self._unreachable: set[str] = set()     # servers that did not answer in this pass
        self._reports: dict[tuple[int, int], FailedReplica] = {}   # (primary, backup extent) -> report
        self._closed = False

    def close(self, wait: bool = True) -> None:
        """Stop: later passes do nothing. ``wait``: for the syncs in flight (their calls
        have deadlines, up to ``SYNC_TIMEOUT``); without it, a daemon that stops closes
        its memory-server channels next, which ends them."""
        self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def report(self, reports: Iterable[FailedReplica]) -> None:
        """Backups that primaries reported they cannot reach (from heartbeats; the
        controller wakes the repair thread); the next pass checks and acts on them.
        Thread-safe. Servers repeat a report with every heartbeat while it lasts, so a
        pass that ignores one loses nothing."""
        with self._lock:
            for r in reports:
                self._reports[(r.primary_extent_id, r.backup_extent_id)] = r

    def reset(self) -> None:
        """Forget what was pushed (a new leader pushes every slot's settings again)."""
        self.moves.forget()
        with self._lock:
            self._reports.clear()
            self._applied.clear()
            self._promoting.clear()
            self._registered.clear()
            self._warned.clear()

    def busy(self) -> bool:
        """True while a sync runs."""
        with self._lock:
            return any(not f.done() for f in self._in_flight.values())

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the syncs in flight (tests)."""
        with self._lock:
            pending = list(self._in_flight.values())
        futures.wait(pending, timeout)

    # -- a pass ----------------------------------------------------------------------------
    def run_pass(self) -> None:
        """Fence every replicated slot that needs it, then start the syncs it needs."""
        if self._closed:
            return
        servers = self.state.list_servers()
        suspect = self._restarted(servers)
        self._unreachable = set()
        with self._lock:
            reports, self._reports = list(self._reports.values()), {}
        if reports:
            self._drop_unreachable(reports)
        by_id = {s.server_id: s for s in servers}
        self.evacuations = {s.server_id: self.evacuations.get(s.server_id, (time.time(), s.used))
                            for s in servers if s.evacuating}
        moving = self.moves.picked()
        swaps = self.moves.swapping()
        listed = self.state.list_regions()
        heads = head_bytes(listed)   # kept up to date by the handovers of this pass
        regions = [r for r in listed if self._tended(r, by_id, moving)]
        for region in regions:
            for index in sorted({e.index for e in region.extents}):
                head = next((c.copy for c in region.copies_of(index) if c.extent_id in swaps), -1)
                try:
                    region = self._fence(region, index, suspect, leaving(region, index, by_id, moving), heads,
                                         head)
                except errors.RegionNotFound:
                    break   # deleted meanwhile
                except errors.ControllerUnavailable:
                    raise
                except errors.SMBError as exc:
                    log.warning("region %s slot %d: %s", region.name, index, exc)
        now = self.clock()
        with self._lock:
            avoid = {sid for sid, until in self._avoid.items() if until > now}
            self._in_flight = {k: f for k, f in self._in_flight.items() if not f.done()}
        avoid |= {s.server_id for s in servers if s.evacuating}
        regions = self.state.list_regions()
        servers = self.state.list_servers()
        by_id = {s.server_id: s for s in servers}
        moving = self.moves.update(regions, servers, now)
        self.metrics.move_bytes_left = self.moves.leaving_bytes
        for region in regions:
            if region.state in ("lost", "creating") or not self._tended(region, by_id, moving):
                continue
            for index in sorted({e.index for e in region.extents}):
                leave = leaving(region, index, by_id, moving)
                prefer = next((moving[c.extent_id] for c in region.copies_of(index)
                               if c.extent_id in moving), "")
                servers = self._start_sync(region, index, servers, avoid, now, leave, prefer)

    @staticmethod
    def _tended(region: RegionRecord, servers: dict[str, ServerRecord], moving: Mapping[int, str]) -> bool:
        """Whether a pass looks at ``region``: replicated, or an unreplicated one being
        moved (or moved before: its slot has a view)."""
        if region.replicas > 1:
            return True
        return any(e.view > 0 or e.extent_id in moving
                   or (e.server_id in servers and servers[e.server_id].evacuating) for e in region.extents)

    def _drop_unreachable(self, reports: Sequence[FailedReplica]) -> None:
        """Act on the reports that :func:`plan_report` trusts: the backup becomes
        ``stale`` (view + 1), its server is avoided for ``AVOID_SECONDS`` (no resync, no
        new copy there meanwhile: no hot loop against a partition), and the primary is
        configured without it, which answers the mutations that waited for it."""
        by_extent = {e.extent_id: r for r in self.state.list_regions() if r.replicas > 1 for e in r.extents}
        for report in reports:
            region = by_extent.get(report.primary_extent_id)
            planned = plan_report(region, report) if region is not None else None
            if region is None or planned is None:
                log.debug("ignored a report from server %s that primary extent %d cannot reach backup "
                          "extent %d at view %d: not the slot's primary at its view, or dropped already",
                          report.server_id, report.primary_extent_id, report.backup_extent_id, report.view)
                continue
            change, backup = planned
            try:
                result = self.state.change_slot(region.name, region.uid, change)
            except errors.RegionNotFound:
                continue
            except errors.ControllerUnavailable:
                raise
            except errors.SMBError as exc:
                log.warning("region %s slot %d: dropping an unreachable backup: %s", region.name,
                            change.index, exc)
                continue
            if result is None:
                continue   # changed meanwhile: the server reports again if it still matters
            region, removed = result
            for e in region.extents:
                by_extent[e.extent_id] = region
            self.metrics.done("unreachable")
            self._avoid_server(backup.server_id)
            log.warning("region %s slot %d: the primary on server %s cannot reach copy %d on server %s "
                        "(%s); the copy is dropped from the replica set (view %d) and repaired "
                        "elsewhere, or resynced once its server can be reached (not before %.0f s)",
                        region.name, change.index, report.server_id, backup.copy, backup.server_id,
                        report.reason or "no reason given", change.view + 1, AVOID_SECONDS)
            self._release(region.uid, removed)
            self._push(region, change.index)

    def _restarted(self, servers: Sequence[ServerRecord]) -> set[str]:
        """Servers that registered again since the last pass (not on the first)."""
        suspect = set()
        with self._lock:
            first = not self._registered
            for s in servers:
                before = self._registered.get(s.server_id)
                if not first and before is not None and s.registered_at > before:
                    log.warning("server %s registered again: its copies are re-synced, not trusted",
                                s.server_id)
                    suspect.add(s.server_id)
                self._registered[s.server_id] = s.registered_at
        return suspect

    def _fence(self, region: RegionRecord, index: int, suspect: set[str],
               leave: frozenset[int] = frozenset(), heads: dict[str, int] | None = None,
               head: int = -1) -> RegionRecord:
        key = (region.uid, index)
        heads = {} if heads is None else heads
        before = head_of(region.copies_of(index))
        fence = plan_fence(region, index, suspect, leave, heads, head)
        if fence is not None:
            planned_on = region
            # a handover drains the old primary when its forwarding set is the store's
            # (this controller pushed the slot's view): then the staying copies need no copy
            graceful = GRACEFUL_HANDOVER and fence.kind in ("handover", "swap") and region.replicas > 1 \
                and self._pushed(key, region.view_of(index))
            result = self.state.change_slot(region.name, region.uid, fence.change)
            if result is None:
                return region      # changed meanwhile: the next pass decides again
            region, removed = result
            if graceful:
                drained = self._drain(planned_on, region, index)
                if drained is not None:
                    region, more = drained
                    removed = [*removed, *more]
            after = head_of(region.copies_of(index))
            if before is not None and after is not None and after.server_id != before.server_id:
                heads[before.server_id] = heads.get(before.server_id, 0) - before.length
                heads[after.server_id] = heads.get(after.server_id, 0) + after.length
            self.metrics.done(fence.kind)
            if fence.kind == "swap":
                log.info("region %s slot %d: role swap, %s (view %d)", region.name, index,
                         fence.change.describe(), region.view_of(index))
            elif fence.kind in ("leave", "handover"):   # the leaving copies stop serving now
                self.metrics.moved(sum(c.length for c in planned_on.copies_of(index) if c.copy in leave
                                       and fence.change.roles.get(c.copy) == ReplicaRole.STALE))
                log.info("region %s slot %d: %s (view %d)", region.name, index, fence.change.describe(),
                         region.view_of(index))
            elif fence.kind == "promote":
                new = region.primary_of(index)
                log.warning("region %s slot %d: copy %d on server %s is the primary now (view %d)",
                            region.name, index, new.copy, new.server_id, new.view)
            elif fence.change.roles:
                log.warning("region %s slot %d: dead copies dropped from the replica set: %s (view %d)",
                            region.name, index, fence.change.describe(), region.view_of(index))
            self._release(region.uid, removed)
            self._push(region, index, promotion=fence.kind in ("promote", "handover", "swap"))
            return region
        view = region.view_of(index)
        with self._lock:   # view 1: configured by the create, before its commit
            pushed = view <= 1 or self._applied.get(key) == view
            busy = key in self._in_flight and not self._in_flight[key].done()
        # a slot with a syncing copy is configured by its sync, at a fresh view
        syncing = any(c.role == ReplicaRole.SYNCING for c in region.copies_of(index))
        if not pushed and not busy and not syncing:
            self._push(region, index, promotion=key in self._promoting)
        return region

    def _pushed(self, key: Key, view: int) -> bool:
        """Whether slot ``key``'s copies were configured at ``view`` (by this controller,
        or by the create for view 1) and no sync of it runs: its primary forwards to
        exactly the store's backups, each of them live when configured."""
        with self._lock:
            busy = key in self._in_flight and not self._in_flight[key].done()
            return not busy and (view <= 1 or self._applied.get(key) == view)

    def _drain(self, before: RegionRecord, after: RegionRecord,
               index: int) -> tuple[RegionRecord, list[ExtentRecord]] | None:
        """A graceful handover's second half (the change that made another copy the
        primary, with the staying copies ``syncing``, is stored): the old primary is
        configured a backup at the new view first, which drains its forwarding (the
        call waits for the piece it forwards under the extent's lock, and it applies
        nothing after), then the staying copies that were in step are recorded backups
        again (:func:`.repair_plans.plan_drained`), so none is copied. None when the old
        primary could not be drained (unreachable, or it had marked a backup failed:
        that one missed mutations): the staying copies are synced from the new primary
        as after any promotion. Returns the region and the copies dropped."""
        old = next(c for c in before.copies_of(index) if c.role == ReplicaRole.PRIMARY)
        demoted = next((c for c in after.copies_of(index) if c.copy == old.copy), None)
        if demoted is None or old.dead:
            return None
        view = after.view_of(index)
        try:
            self.servers.configure_replicas(old.grpc_address, after.uid, demoted, view, ReplicaRole.BACKUP, [])
        except errors.SMBError as exc:
            log.info("region %s slot %d: the old primary on %s was not drained (%s); the copies that "
                     "stay are synced again from the new primary", after.name, index, old.server_id, exc)
            return None
        in_step = frozenset(c.copy for c in before.copies_of(index)
                            if c.role == ReplicaRole.BACKUP and not c.dead) | {old.copy}
        change = plan_drained(after, index, in_step)
        if change is None:
            return after, []
        result = self.state.change_slot(after.name, after.uid, change)
        if result is None:
            return None
        self.metrics.done("drained")
        log.info("region %s slot %d: old primary on %s drained, %s (view %d)", after.name, index,
                 old.server_id, change.describe(), result[0].view_of(index))
        return result

    def _push(self, region: RegionRecord, index: int, promotion: bool = False) -> bool:
        """Configure slot ``index``'s live copies at its view: after a promotion backups
        and syncing copies first, then the primary; else the primary first, then its
        backups. Syncing copies are no primary's backups here (a sync brings them in).
        True when every call succeeded."""
        key = (region.uid, index)
        copies = region.copies_of(index)
        view = region.view_of(index)
        primary = next((c for c in copies if c.role == ReplicaRole.PRIMARY), None)
        if promotion:
            with self._lock:
                self._promoting.add(key)
        if primary is None or primary.dead:
            return False
        backups = [c for c in copies if c.role == ReplicaRole.BACKUP and not c.dead]
        # an unreplicated slot that a move left with one copy serves as an unreplicated extent again
        alone = region.replicas == 1 and not backups
        head: tuple[ExtentRecord, ReplicaRole, list[Backup]] = (
            primary, ReplicaRole.NONE if alone else ReplicaRole.PRIMARY, [Backup(b) for b in backups])
        if promotion:
            fenced = [c for c in copies if c.role in (ReplicaRole.BACKUP, ReplicaRole.SYNCING) and not c.dead]
            calls: list[tuple[ExtentRecord, ReplicaRole, list[Backup]]] = [
                (c, ReplicaRole.BACKUP, []) for c in fenced] + [head]
        else:
            calls = [head] + [(c, ReplicaRole.BACKUP, []) for c in backups]
        for extent, role, targets in calls:
            if extent.server_id in self._unreachable:
                return False
            try:
                self.servers.configure_replicas(extent.grpc_address, region.uid, extent, view, role, targets)
            except errors.SMBError as exc:
                if isinstance(exc, (errors.Unavailable, errors.Timeout)):
                    self._unreachable.add(extent.server_id)   # not again in this pass
                log.warning("region %s slot %d: configuring copy %d on server %s as %s (view %d): %s; "
                            "the next pass tries again", region.name, index, extent.copy,
                            extent.server_id, role, view, exc)
                return False
        with self._lock:
            self._applied[key] = view
            self._promoting.discard(key)
        return True

    def _release(self, region_uid: str, removed: Sequence[ExtentRecord]) -> None:
        """Free dropped copies, best effort (down servers and lost copies skipped: an
        unreachable server's extent is an orphan it frees when it returns)."""
        for e in removed:
            if e.dead:
                continue
            try:
                self.servers.release(e.grpc_address, region_uid, e)
            except errors.SMBError as exc:
                log.info("could not release dropped copy %d on server %s: %s; it will be freed "
                         "as an orphan", e.extent_id, e.server_id, exc)

    # -- syncs -----------------------------------------------------------------------------
    def _start_sync(self, region: RegionRecord, index: int, servers: list[ServerRecord],
                    avoid: set[str], now: float, leave: frozenset[int] = frozenset(),
                    prefer: str = "") -> list[ServerRecord]:
        """Start the sync slot ``index`` needs; returns ``servers`` with the bytes a new
        copy takes counted (so the next slots of the pass see them used)."""
        key = (region.uid, index)
        with self._lock:
            if key in self._in_flight or self._retry_at.get(key, 0.0) > now:
                return servers
        plan = plan_sync(region, index, servers, avoid, leave, prefer)
        if plan is None:
            short = sum(holds_all(c) and c.copy not in leave for c in region.copies_of(index)) < region.replicas
            primary = region.primary_of(index)
            if short and not primary.dead and key not in self._warned:
                self._warned.add(key)
                log.warning("region %s slot %d has %d of %d copies%s and no spare server to copy to "
                            "(up, not draining, %d bytes free, no copy of it); it stays %s",
                            region.name, index, sum(holds_all(c) and c.copy not in leave
                                                    for c in region.copies_of(index)),
                            region.replicas, " that stay" if leave else "", primary.length,
                            "where it is" if leave else "degraded")
            return servers
        self._warned.discard(key)
        with self._lock:
            self._in_flight[key] = self._pool.submit(self._sync, region, plan)
        if plan.kind == "spare":
            length = region.copies_of(index)[0].length
            servers = [dataclasses.replace(s, used=s.used + length) if s.server_id == plan.server_id else s
                       for s in servers]
        return servers

    def _sync(self, region: RegionRecord, plan: SyncPlan) -> None:
        key = (region.uid, plan.index)
        self.metrics.started(1)
        try:
            if not self._sync_steps(region, plan):
                with self._lock:
                    self._retry_at[key] = self.clock() + RETRY_SECONDS
        except errors.RegionNotFound:
            pass
        except Exception:
            log.exception("region %s slot %d: repair (%s)", region.name, plan.index, plan.kind)
            with self._lock:
                self._retry_at[key] = self.clock() + RETRY_SECONDS
        finally:
            self.metrics.started(-1)

    def _avoid_server(self, server_id: str) -> None:
        with self._lock:
            self._avoid[server_id] = self.clock() + AVOID_SECONDS

    def _sync_steps(self, region: RegionRecord, plan: SyncPlan) -> bool:
        """Bring one copy into slot ``plan.index``; False when a step failed (the next
        pass after ``RETRY_SECONDS`` drives on from what the store says)."""
        index, view = plan.index, region.view_of(plan.index)
        start = self.clock()
        if plan.kind == "spare":
            copy = free_copy_number(region, index)
            head = region.primary_of(index)   # an unreplicated slot's extent becomes the primary of a move
            roles = {head.copy: ReplicaRole.PRIMARY} if head.role == ReplicaRole.NONE else {}
            change = SlotChange(index, view, roles, add=NewCopy(copy, plan.server_id, ReplicaRole.SYNCING))
        elif plan.kind == "resync":
            copy = plan.copy
            change = SlotChange(index, view, {copy: ReplicaRole.SYNCING})
        else:
            copy = plan.copy
            change = SlotChange(index, view)   # a fresh view: the sync runs again in full
        result = self.state.change_slot(region.name, region.uid, change)
        if result is None:
            return True        # changed meanwhile: the next pass decides again
        region, _ = result
        view = region.view_of(index)
        target = next(c for c in region.copies_of(index) if c.copy == copy)
        primary = region.primary_of(index)
        log.info("region %s slot %d: bringing copy %d (extent %d) on server %s in step from the "
                 "primary on %s (%s, view %d, %d bytes)", region.name, index, copy, target.extent_id,
                 target.server_id, primary.server_id, plan.kind, view, target.length)
        try:
            self.servers.reserve(target.grpc_address, region.uid, target, region.persistent)
        except errors.SMBError as exc:
            log.warning("region %s slot %d: server %s cannot take copy %d: %s", region.name, index,
                        target.server_id, copy, exc)
            self._avoid_server(target.server_id)
            undo = (SlotChange(index, view, remove=frozenset({copy})) if plan.kind == "spare"
                    else SlotChange(index, view, {copy: ReplicaRole.STALE}))
            self.state.change_slot(region.name, region.uid, undo)
            return False
        try:
            self.servers.configure_replicas(target.grpc_address, region.uid, target, view, ReplicaRole.BACKUP, [])
        except errors.SMBError as exc:
            log.warning("region %s slot %d: configuring copy %d on server %s as a backup: %s",
                        region.name, index, copy, target.server_id, exc)
            self._avoid_server(target.server_id)
            self.state.change_slot(region.name, region.uid, SlotChange(index, view, {copy: ReplicaRole.STALE}))
            return False
        backups = [Backup(c) for c in region.copies_of(index) if c.role == ReplicaRole.BACKUP and not c.dead]
        try:
            _, synced = self.servers.configure_replicas(
                primary.grpc_address, region.uid, primary, view, ReplicaRole.PRIMARY, backups + [Backup(target, True)])
        except errors.SMBError as exc:
            log.warning("region %s slot %d: the primary on %s could not copy to server %s: %s",
                        region.name, index, primary.server_id, target.server_id, exc)
            return False
        seconds = self.clock() - start
        copies = region.copies_of(index)
        in_sync = sum(c.in_sync for c in copies) + 1
        remove = frozenset(c.copy for c in copies if c.role == ReplicaRole.STALE) if in_sync >= region.replicas \
            else frozenset()
        result = self.state.change_slot(region.name, region.uid,
                                        SlotChange(index, view, {copy: ReplicaRole.BACKUP}, remove))
        if result is None:
            log.info("region %s slot %d changed during the sync; the next pass decides again",
                     region.name, index)
            return True
        region, removed = result
        self._release(region.uid, removed)
        self.metrics.done(plan.kind, synced, seconds)
        log.info("region %s slot %d: copy %d on server %s in step (%d bytes copied in %.3f s, "
                 "%.0f MB/s); %d of %d copies", region.name, index, copy, target.server_id, synced,
                 seconds, synced / max(seconds, 1e-9) / 1e6, in_sync, region.replicas)
        self._push(region, index)
        self.wake()   # after the push: a handover that follows finds the slot pushed, and drains
        return True
