"""The decisions of a repair pass (:mod:`.repair` describes the pass): pure functions
from a region's records and the servers' to the change of one slot, or the copy a sync
brings in. No I/O here.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from smb_protocol.replicas import IN_SYNC, ReplicaRole

from .moves import head_of, holds_all, new_head, slots_headed
from .records import ExtentRecord, FailedReplica, RegionRecord, ServerRecord, SlotChange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fence:
    """A fencing change of one slot and whether it replaces the primary."""

    change: SlotChange
    #: promote | drop | handover (a leaving primary replaced) | leave (leaving backups
    #: dropped) | swap (a backup made the primary, the primary kept as a backup)
    kind: str


def plan_fence(region: RegionRecord, index: int, suspect: Iterable[str] = (),
               leave: frozenset[int] = frozenset(), heads: Mapping[str, int] = {},
               head: int = -1) -> Fence | None:
    """The change that takes dead copies out of slot ``index``'s replica set (:mod:`.repair`,
    step 1), or else the copies in ``leave`` (:func:`.moves.leaving`) once enough others
    are in step (:func:`plan_leave`, ``heads`` as there), or else makes copy ``head``
    the primary (:func:`plan_swap`; -1: none), or None. ``suspect``: servers whose
    copies count as dead while the slot has an in-sync copy on another server."""
    fence = _plan_dead(region, index, suspect)
    if fence is None and leave:
        return plan_leave(region, index, leave, heads)
    if fence is None and head >= 0:
        return plan_swap(region, index, head)
    return fence


def plan_swap(region: RegionRecord, index: int, head: int) -> Fence | None:
    """Make backup ``head`` of slot ``index`` its primary and keep the primary as a
    backup (a rebalance's role swap, :func:`.heads.plan_heads`); None unless every copy
    of the slot is in step and ``head`` is a live backup. Recorded as any handover is
    (the old primary and the other backups ``syncing``: one may have applied a mutation
    the new primary never saw), until the old primary's forwarding is drained
    (:func:`plan_drained`)."""
    copies = region.copies_of(index)
    primary = next((c for c in copies if c.role == ReplicaRole.PRIMARY), None)
    new = next((c for c in copies if c.copy == head), None)
    if (primary is None or new is None or new.role != ReplicaRole.BACKUP or new.dead
            or new.server_state != "up" or not all(holds_all(c) for c in copies)):
        return None
    roles = {c.copy: ReplicaRole.SYNCING for c in copies if c.role == ReplicaRole.BACKUP}
    roles[primary.copy], roles[new.copy] = ReplicaRole.SYNCING, ReplicaRole.PRIMARY
    return Fence(SlotChange(index, region.view_of(index), roles), "swap")


def plan_drained(region: RegionRecord, index: int, in_step: frozenset[int]) -> SlotChange | None:
    """After a handover or swap (recorded with the staying copies ``syncing``) drained
    the old primary's forwarding: the copies in ``in_step`` (the backups before it, and
    the old primary when it stays) that are ``syncing`` are backups again -- every
    mutation the old primary applied reached them, and none applies until the new
    primary is configured -- and the ``stale`` copies (a leaving old primary) are
    dropped once ``replicas`` copies are in step. None when nothing changes."""
    copies = region.copies_of(index)
    roles = {c.copy: ReplicaRole.BACKUP for c in copies
             if c.copy in in_step and c.role == ReplicaRole.SYNCING and not c.dead}
    after = {c.copy: roles.get(c.copy, c.role) for c in copies}
    in_sync = sum(1 for c in copies if after[c.copy] in IN_SYNC and not c.dead)
    remove = frozenset(c.copy for c in copies if after[c.copy] == ReplicaRole.STALE and in_sync >= region.replicas)
    if not roles and not remove:
        return None
    return SlotChange(index, region.view_of(index), roles, remove)


def plan_leave(region: RegionRecord, index: int, leave: frozenset[int],
               heads: Mapping[str, int] = {}) -> Fence | None:
    """Take the copies in ``leave`` out of slot ``index`` once ``replicas`` in-step
    copies stay: leaving backups become ``stale`` and are dropped; a leaving primary
    is replaced by a backup that stays (a handover: backups first, which fences it), the
    one on the server heading the fewest of the region's other slots, then the fewest
    bytes (``heads``, :func:`.moves.new_head`);
    the other staying copies become ``syncing`` as after any promotion (one may have
    applied a mutation the new primary refused), until a graceful handover drained the
    old primary (:func:`plan_drained`)."""
    copies = region.copies_of(index)
    stay = [c for c in copies if c.in_sync and c.copy not in leave]
    primary = next((c for c in copies if c.role == ReplicaRole.PRIMARY), None)
    if primary is None or primary.dead or len(stay) < region.replicas:
        return None
    roles: dict[int, ReplicaRole] = {c.copy: ReplicaRole.STALE for c in copies
                                     if c.copy in leave and c.role != ReplicaRole.STALE}
    kind = "leave"
    if primary.copy in leave:
        new = new_head([c for c in stay if c.role == ReplicaRole.BACKUP], heads, slots_headed(region, index))
        roles[new.copy] = ReplicaRole.PRIMARY
        for c in copies:
            if c.copy not in leave and c.copy != new.copy and c.role in (ReplicaRole.BACKUP, ReplicaRole.SYNCING):
                roles[c.copy] = ReplicaRole.SYNCING
        kind = "handover"
    after = {c.copy: roles.get(c.copy, c.role) for c in copies}
    in_sync = sum(1 for c in copies if after[c.copy] in IN_SYNC and not c.dead)
    remove = frozenset(c.copy for c in copies if after[c.copy] == ReplicaRole.STALE and in_sync >= region.replicas)
    if not roles:
        return None
    return Fence(SlotChange(index, region.view_of(index), roles, remove), kind)


def _plan_dead(region: RegionRecord, index: int, suspect: Iterable[str]) -> Fence | None:
    copies = region.copies_of(index)
    suspect = set(suspect)
    trusted = [c for c in copies if c.in_sync and c.server_id not in suspect]
    gone = {c.copy for c in copies if c.dead or (trusted and c.server_id in suspect)}
    primary = next((c for c in copies if c.role == ReplicaRole.PRIMARY), None)
    if primary is None:
        return None
    roles: dict[int, ReplicaRole] = {}
    kind = "drop"
    if primary.copy in gone:
        candidates = [c for c in copies if c.role == ReplicaRole.BACKUP and c.copy not in gone]
        if not candidates:
            return None   # nothing to promote: wait for a copy to come back
        new = min(candidates, key=lambda c: (c.server_state != "up", c.copy))
        roles[primary.copy], roles[new.copy] = ReplicaRole.STALE, ReplicaRole.PRIMARY
        for c in copies:
            if c.copy not in (primary.copy, new.copy) and c.role in (ReplicaRole.BACKUP, ReplicaRole.SYNCING):
                roles[c.copy] = ReplicaRole.STALE if c.copy in gone else ReplicaRole.SYNCING
        kind = "promote"
    else:
        for c in copies:
            if c.copy in gone and c.role in (ReplicaRole.BACKUP, ReplicaRole.SYNCING):
                roles[c.copy] = ReplicaRole.STALE
    after = {c.copy: roles.get(c.copy, c.role) for c in copies}
    in_sync = sum(1 for c in copies if after[c.copy] in IN_SYNC and c.copy not in gone)
    remove = frozenset(c.copy for c in copies if after[c.copy] == ReplicaRole.STALE and in_sync >= region.replicas)
    if not roles and not remove:
        return None
    return Fence(SlotChange(index, region.view_of(index), roles, remove), kind)


def plan_report(region: RegionRecord, report: FailedReplica) -> tuple[SlotChange, ExtentRecord] | None:
    """The change that takes the backup a primary reported as unreachable out of its
    slot (it becomes ``stale``), with that backup; None unless the reporting server holds
    the slot's live primary, the slot is at the report's view and the backup is in the
    replica set (backup or syncing) -- a deposed primary, an old view or a copy already
    dropped change nothing."""
    primary = next((e for e in region.extents if e.extent_id == report.primary_extent_id), None)
    if (primary is None or primary.role != ReplicaRole.PRIMARY or primary.dead
            or primary.server_id != report.server_id
            or region.view_of(primary.index) != report.view):
        return None
    backup = next((c for c in region.copies_of(primary.index)
                   if c.extent_id == report.backup_extent_id), None)
    if backup is None or backup.role not in (ReplicaRole.BACKUP, ReplicaRole.SYNCING):
        return None
    return SlotChange(primary.index, report.view, {backup.copy: ReplicaRole.STALE}), backup


@dataclass(frozen=True)
class SyncPlan:
    """The copy a sync brings into slot ``index``: ``copy`` (redrive, resync) or a new
    one on ``server_id`` (spare)."""

    index: int
    kind: str          # redrive | resync | spare
    copy: int = -1
    server_id: str = ""


def pick_spare(region: RegionRecord, index: int, servers: Sequence[ServerRecord],
               avoid: Iterable[str] = ()) -> ServerRecord | None:
    """A server for a new copy of slot ``index``: up (not draining, not down), holding
    no copy of the slot, with the slot's length free, not in ``avoid``; a host without
    a live copy of the slot first, then the most free bytes."""
    copies = region.copies_of(index)
    length = copies[0].length
    taken = {c.server_id for c in copies}
    hosts = {c.host_id for c in copies if not c.dead}
    avoid = set(avoid)
    fits = [s for s in servers if s.state == "up" and s.server_id not in taken
            and s.server_id not in avoid and s.free >= length]
    if not fits:
        return None
    return min(fits, key=lambda s: (s.host_id in hosts, -s.free, s.server_id))


def plan_sync(region: RegionRecord, index: int, servers: Sequence[ServerRecord],
              avoid: Iterable[str] = (), leave: frozenset[int] = frozenset(),
              prefer: str = "") -> SyncPlan | None:
    """The copy to bring into slot ``index`` now (:mod:`.repair`, step 2), or None
    (in step, no live primary, or nowhere to put one). Copies in ``leave`` do not count
    as in step (a move brings their replacement in); a new copy goes to ``prefer``
    when that server fits (:func:`pick_spare`'s rules). An unreplicated slot's extent
    is its primary here (a move makes it one)."""
    copies = region.copies_of(index)
    avoid = set(avoid)
    primary = head_of(copies)
    if primary is None or primary.dead:
        return None
    usable = [c for c in copies if not c.dead and c.server_id not in avoid]
    syncing = [c for c in usable if c.role == ReplicaRole.SYNCING]
    if syncing:
        return SyncPlan(index, "redrive", syncing[0].copy)
    if sum(holds_all(c) and c.copy not in leave for c in copies) >= region.replicas:
        return None
    stale = [c for c in usable if c.role == ReplicaRole.STALE]
    if stale:
        return SyncPlan(index, "resync", stale[0].copy)
    preferred = [s for s in servers if s.server_id == prefer]
    spare = (pick_spare(region, index, preferred, avoid) if preferred else None) \
        or pick_spare(region, index, servers, avoid)
    if spare is None:
        return None
    return SyncPlan(index, "spare", server_id=spare.server_id)


def free_copy_number(region: RegionRecord, index: int) -> int:
    """The lowest copy number slot ``index`` does not use (copy numbers are stable, so a
    new copy may get one beyond ``replicas - 1`` while a stale copy keeps its own)."""
    used = {c.copy for c in region.copies_of(index)}
    return next(n for n in range(len(used) + 1) if n not in used)
