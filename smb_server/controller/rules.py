"""The controller's rules: pure functions from the records a store loads to the changes
it makes, tested without any store.

The stores (:class:`.stores.sqlite.state.ControllerState` on SQLite,
:class:`.stores.etcd.state.EtcdState` on etcd) only load what a rule takes and apply what
it returns atomically: one SQLite transaction, or one etcd transaction retried from a
fresh read when it lost a race.
Checks of what callers send are in :mod:`.records`; the evacuation rules in :mod:`.moves`.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from smb_protocol.errors import InvalidArgument, RegionExists, RegionNotFound, ServerNotFound
from smb_protocol.placement import Layout, check_bytes
from smb_protocol.replicas import ReplicaRole

from .records import (
    DELETE_MEMORY_SECONDS,
    CreateRequest,
    DeletedRegion,
    ExtentRecord,
    HeldExtent,
    RegionRecord,
    ServerRecord,
    SlotChange,
    check_slot_change,
    initial_role,
)

log = logging.getLogger(__name__)


# -- a store's settings and memory servers --------------------------------------------------
def check_settings(lease_seconds: float, orphan_grace_seconds: float) -> tuple[float, float]:
    """A store's lease (seconds, more than 0) and orphan grace (seconds, at least 0).
    Raises InvalidArgument."""
    if lease_seconds <= 0:
        raise InvalidArgument(f"lease must be positive, got {lease_seconds} seconds")
    if orphan_grace_seconds < 0:
        raise InvalidArgument(f"orphan grace must not be negative, got {orphan_grace_seconds}")
    return float(lease_seconds), float(orphan_grace_seconds)


def check_registration(server_id: str, grpc_address: str, capacity: int) -> tuple[str, int]:
    """A registering server's id (a generated one for "") and capacity (bytes). Raises
    InvalidArgument (no gRPC address, a capacity that is not a byte count)."""
    if not grpc_address:
        raise InvalidArgument("a memory server must give its gRPC address")
    return server_id or uuid.uuid4().hex[:12], check_bytes("capacity", capacity)


def find_server(servers: Iterable[ServerRecord], server_id: str) -> ServerRecord:
    """Server ``server_id`` among ``servers``; raises ServerNotFound."""
    for s in servers:
        if s.server_id == server_id:
            return s
    raise ServerNotFound(f"no memory server {server_id!r}")


def live_state(drain: int) -> str:
    """The state of a server that registers or heartbeats: ``draining`` while its drain
    flag (:data:`.moves.DRAIN_STOP` or ``DRAIN_EVACUATE``) is set, else ``up``."""
    return "draining" if drain else "up"


def drained_state(state: str, undrain: bool) -> str:
    """A server's state after a drain (``undrain``: its end); a down server stays down."""
    return state if state == "down" else ("up" if undrain else "draining")


def lease_ran_out(state: str, last_heartbeat: float, now: float, lease_seconds: float) -> bool:
    """A server not yet down whose last heartbeat (unix seconds) is more than
    ``lease_seconds`` before ``now``: it is marked down."""
    return state != "down" and last_heartbeat < now - lease_seconds


def refreshed_on_take_over(state: str, last_heartbeat: float, now: float) -> bool:
    """A live server whose lease a new leader renews to ``now``: a whole lease to find
    the new leader, so that a take-over marks down no server that was up."""
    return state != "down" and last_heartbeat < now


def lost_on_register(server_id: str, known: Mapping[int, tuple[str, str]],
                     held: Iterable[HeldExtent]) -> list[int]:
    """The extents a registering server lost, by id: placed on it in a ready region
    (``known``: extent id -> (region uid, region state)) and not among those it holds
    (it restarted without persistence). Their regions are lost."""
    held_ids = {h.extent_id for h in held}
    lost = sorted(eid for eid, (_, state) in known.items() if state == "ready" and eid not in held_ids)
    if lost:
        log.warning("server %s does not hold %d extent(s) the controller placed on it "
                    "(restarted without persistence?); their regions are lost: %s",
                    server_id, len(lost), ", ".join(map(str, lost[:10])))
    return lost


# -- regions ----------------------------------------------------------------------------------
def check_new_region(req: CreateRequest, existing: str | None, uid_taken: bool) -> None:
    """Raise RegionExists when a region of the requested name exists (``existing``: its
    stored state, None when there is none), InvalidArgument when another region has its uid."""
    if existing is not None:
        what = " (being created)" if existing == "creating" else ""
        raise RegionExists(f"region {req.name!r} already exists{what}; open it, delete it, or pass exist_ok")
    if uid_taken:
        raise InvalidArgument(f"uid {req.uid} already names another region; draw a new one")


@dataclass(frozen=True)
class PlannedExtent:
    """One copy of one slot of a region being planned (the store draws its extent id)."""

    index: int
    server_id: str
    length: int        # bytes
    copy: int
    role: ReplicaRole
    view: int


def plan_region(req: CreateRequest, servers: Iterable[ServerRecord], now: float, lease_seconds: float,
                taken: Mapping[str, int] | None = None) -> tuple[Layout, list[PlannedExtent]]:
    """Where a new region goes: its layout and every copy of every slot, in order.

    Only servers ``up`` (not draining, not down) whose last heartbeat is within
    ``lease_seconds`` of ``now`` take extents, each offering its free bytes less what
    ``taken`` (server id -> bytes) gives to regions planned before it in the same batch.
    Copy 0 of a slot is its primary (:func:`.records.initial_role`). Raises OutOfMemory.
    """
    taken = taken or {}
    up = [s for s in servers if s.state == "up" and s.last_heartbeat >= now - lease_seconds]
    layout, copies = req.plan({s.server_id: max(0, s.free - taken.get(s.server_id, 0)) for s in up},
                              {s.server_id: s.host_id for s in up})
    extents = [PlannedExtent(idx, sid, length, copy, *initial_role(req.replicas, copy))
               for idx, (length, sids) in enumerate(zip(layout.extent_lengths, copies, strict=True))
               for copy, sid in enumerate(sids)]
    return layout, extents


def check_created(name: str, stored_state: str | None, stored_uid: str | None = None,
                  uid: str | None = None) -> None:
    """Raise RegionNotFound unless region ``name`` exists (``stored_state`` not None) and
    is created (not ``creating``), and, with ``uid``, is that incarnation of the name."""
    if stored_state is None or stored_state == "creating" or (uid is not None and stored_uid != uid):
        raise RegionNotFound(f"no region named {name!r}" + (f" (uid {uid})" if uid is not None else ""))


def check_committable(name: str, stored_uid: str | None, uid: str | None = None) -> None:
    """Raise RegionNotFound unless region ``name`` (its uid ``stored_uid``, None when there
    is none) is still there to commit, and, with ``uid``, is that incarnation (a commit is
    idempotent: a region already ready commits again)."""
    if stored_uid is None or (uid is not None and stored_uid != uid):
        raise RegionNotFound(f"region {name!r} was removed while it was being created")


def abortable(stored_state: str | None, stored_uid: str | None, uid: str | None = None) -> bool:
    """A region that an abort removes: one still ``creating`` (of ``uid``, when given);
    an abort of anything else does nothing."""
    return stored_state == "creating" and (uid is None or stored_uid == uid)


def half_created(states: Mapping[str, str]) -> list[str]:
    """The regions (name -> stored state) a controller that died mid-create left
    ``creating``, by name: a new leader removes them, and the extents their servers did
    reserve become orphans the servers free after the grace."""
    return sorted(name for name, state in states.items() if state == "creating")


def report_half_created(names: Iterable[str]) -> None:
    """Log the removal of :func:`half_created` regions (once they are removed)."""
    names = list(names)
    if names:
        log.warning("removed %d region(s) left half-created by a previous controller: %s; "
                    "their extents are freed by the servers as orphans", len(names), ", ".join(names))


def delete_memory_horizon(now: float) -> float:
    """Unix seconds before which a done delete is forgotten (its retries are answered
    as done for :data:`.records.DELETE_MEMORY_SECONDS`)."""
    return now - DELETE_MEMORY_SECONDS


def retried_delete(name: str, record: str) -> DeletedRegion | None:
    """The answer to a delete of region ``name`` retried with a request id that is
    remembered: the region that delete removed (``record``: :meth:`.records.DeletedRegion.dump`,
    or an older controller's bare name), or None when it removed another region."""
    was, deleted = DeletedRegion.load(record)
    return deleted if was == name else None


# -- replica sets -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlotOutcome:
    """What one :class:`.records.SlotChange` does to its slot: the copies it keeps (at
    their new role and view), the copies it removes (the caller releases them) and the
    copy it adds."""

    kept: tuple[ExtentRecord, ...]
    removed: tuple[ExtentRecord, ...]
    added: ExtentRecord | None = None

    @property
    def slot(self) -> tuple[ExtentRecord, ...]:
        """Every copy of the slot after the change, by copy number."""
        return tuple(sorted(self.kept + ((self.added,) if self.added else ()), key=lambda e: e.copy))


def slot_change(region: RegionRecord, change: SlotChange, servers: Iterable[str] = (),
                new_extent_id: int = 0) -> SlotOutcome | None:
    """Apply ``change`` to its slot of ``region``; None when the slot is no longer at
    ``change.view`` (another change won: decide again).

    Every copy the slot keeps, and the new one (extent id ``new_extent_id``, which the
    store draws fresh, never reused, when the change adds a copy, on
    ``change.add.server_id`` with the slot's length), is at view ``change.view + 1``.
    Raises InvalidArgument for a change that does not fit (:func:`.records.check_slot_change`;
    ``servers``: the known server ids).
    """
    if region.view_of(change.index) != change.view:
        return None
    check_slot_change(region, change, servers)
    copies = region.copies_of(change.index)
    view = change.view + 1
    kept = tuple(replace(e, role=change.roles.get(e.copy, e.role), view=view)
                 for e in copies if e.copy not in change.remove)
    removed = tuple(e for e in copies if e.copy in change.remove)
    added = None
    if change.add is not None:
        if not new_extent_id:
            raise ValueError("a change that adds a copy needs a fresh extent id")
        added = ExtentRecord(new_extent_id, change.index, change.add.server_id, copies[0].length,
                             copy=change.add.copy, role=change.add.role, view=view)
    return SlotOutcome(kept, removed, added)


# -- owner leases -----------------------------------------------------------------------------
@dataclass(frozen=True)
class OwnerLease:
    """An owner's lease on its regions: how long each renewal lasts and when it runs out."""

    seconds: float
    expires: float   # unix seconds


def leased(lease: OwnerLease | None, seconds: float, now: float) -> OwnerLease:
    """An owner's lease once it ties one more region to a lease of ``seconds``: the
    longest lease of its regions, running out no earlier than before."""
    if lease is None:
        return OwnerLease(seconds, now + seconds)
    return OwnerLease(max(seconds, lease.seconds), max(now + seconds, lease.expires))


def renewed(lease: OwnerLease | None, now: float) -> OwnerLease | None:
    """A lease renewed at ``now``; None when there is none or it ran out (its regions
    are gone, or going: a renewal does not bring them back)."""
    if lease is None or lease.expires < now:
        return None
    return replace(lease, expires=now + lease.seconds)


def lapsed(owners: Mapping[str, OwnerLease], holders: Mapping[str, str], ready: Iterable[str],
           now: float) -> tuple[list[str], list[str]]:
    """(the ready regions whose owner's lease ran out, by name; the owners whose lease
    ran out that hold no region, which are forgotten). ``holders``: region -> owner."""
    ran_out = {owner for owner, lease in owners.items() if lease.expires < now}
    ready = set(ready)
    regions = sorted(name for name, owner in holders.items() if owner in ran_out and name in ready)
    idle = sorted(ran_out - set(holders.values()))
    return regions, idle
