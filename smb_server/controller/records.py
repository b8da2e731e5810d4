"""The controller's records (servers, regions, extents) and the checks on what callers
send; pure data, no database."""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace

from smb_protocol import placement as placement_mod
from smb_protocol.errors import InvalidArgument
from smb_protocol.names import check_region_name
from smb_protocol.placement import MAX_REPLICAS, Layout, check_bytes
from smb_protocol.replicas import ASSIGNABLE, IN_SYNC, ReplicaRole

log = logging.getLogger(__name__)


# -- records ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeldExtent:
    """An extent a memory server reports holding (from Register/Heartbeat)."""

    extent_id: int
    region_uid: str = ""
    length: int = 0            # bytes
    age_seconds: float = 0.0   # since the server reserved it


@dataclass(frozen=True)
class ServerRecord:
    server_id: str
    host_id: str
    grpc_address: str
    endpoints: tuple[str, ...]
    capacity: int          # bytes
    used: int              # bytes placed on it (sum of its extents)
    extents: int           # number of extents placed on it
    state: str             # up | down | draining
    last_heartbeat: float  # unix seconds
    registered_at: float   # unix seconds
    evacuating: bool = False  # draining, and every copy it holds is to be moved elsewhere

    @property
    def free(self) -> int:
        """Bytes not yet placed (never negative)."""
        return max(0, self.capacity - self.used)


@dataclass(frozen=True)
class ExtentRecord:
    """One extent of a region as the controller keeps it: its place in the layout,
    its server and whether that server lost it. (Clients see
    :class:`smb_protocol.placement.ExtentPlace`.)"""

    extent_id: int
    index: int             # position in the region's layout
    server_id: str
    length: int            # bytes
    grpc_address: str = ""
    host_id: str = ""
    endpoints: tuple[str, ...] = ()
    server_state: str = ""  # up | down | draining
    lost: bool = False      # its server registered again without it
    copy: int = 0           # which copy of its slot (replicated regions; stable while it exists)
    role: ReplicaRole = ReplicaRole.NONE
    view: int = 0           # its slot's replica-set version (0 unreplicated; grows with every change)

    @property
    def dead(self) -> bool:
        """Its server is down or came back without it: it serves nothing now."""
        return self.lost or self.server_state == "down"

    @property
    def in_sync(self) -> bool:
        """A live copy holding every acknowledged byte (primary or backup, not dead)."""
        return self.role in IN_SYNC and not self.dead


@dataclass(frozen=True)
class RegionRecord:
    name: str
    uid: str
    size: int                          # bytes
    placement: str                     # striped | layered | single
    stripe_unit: int                   # bytes (striped only, else 0)
    segment_sizes: tuple[int, ...]     # bytes (layered only)
    segment_extents: tuple[int, ...]   # extent index of each segment (layered only)
    persistent: bool
    created_at: float                  # unix seconds
    state: str                         # creating | ready | degraded | lost
    extents: tuple[ExtentRecord, ...] = field(default=())  # every copy, by (slot, copy)
    replicas: int = 1                  # copies of every byte asked for (1: unreplicated)

    @property
    def lost_servers(self) -> list[str]:
        """The servers that registered without some extent of this region (state ``lost``)."""
        return sorted({e.server_id for e in self.extents if e.lost})

    @property
    def extent_ids(self) -> list[int]:
        """Every copy's extent id (what a region ticket names, what a delete releases)."""
        return [e.extent_id for e in self.extents]

    @property
    def slots(self) -> int:
        """Layout slots (extents of the layout)."""
        return len({e.index for e in self.extents})

    def copies_of(self, index: int) -> list[ExtentRecord]:
        """Every copy of layout slot ``index`` (stale ones included), by copy number."""
        return sorted((e for e in self.extents if e.index == index), key=lambda e: e.copy)

    def primary_of(self, index: int) -> ExtentRecord:
        """Slot ``index``'s primary (in an unreplicated region its one extent; a slot
        without a primary row, which no change leaves, gives its lowest copy)."""
        copies = self.copies_of(index)
        return next((e for e in copies if e.role == ReplicaRole.PRIMARY), copies[0])

    def primaries(self) -> list[ExtentRecord]:
        """One extent per slot, in layout order: the primaries (what unreplicated
        clients and the layout math see)."""
        return [self.primary_of(i) for i in sorted({e.index for e in self.extents})]

    def others(self) -> list[ExtentRecord]:
        """The copies clients may see besides the primaries: backups and syncing copies
        (stale copies are the controller's own business)."""
        primaries = {e.extent_id for e in self.primaries()}
        return [e for e in self.extents
                if e.extent_id not in primaries and e.role in (ReplicaRole.BACKUP, ReplicaRole.SYNCING)]

    def view_of(self, index: int) -> int:
        """Slot ``index``'s replica-set version (0 unreplicated)."""
        return max((e.view for e in self.copies_of(index)), default=0)

    def layout(self) -> Layout:
        """The pure offset -> (extent, offset) mapping of this region (from its slots)."""
        return Layout(self.placement, self.size, tuple(e.length for e in self.primaries()),
                      stripe_unit=self.stripe_unit, segment_sizes=self.segment_sizes,
                      segment_extents=self.segment_extents)


@dataclass(frozen=True)
class FailedReplica:
    """A memory server's report (with its heartbeat) that its primary copy
    ``primary_extent_id`` cannot forward to the backup copy ``backup_extent_id`` at
    ``view``; trusted only from the slot's current primary at that view."""

    server_id: str          # the reporting server
    primary_extent_id: int
    backup_extent_id: int
    view: int
    reason: str = ""


@dataclass(frozen=True)
class NewCopy:
    """A copy a slot change adds; the store draws its extent id (fresh, never reused)."""

    copy: int
    server_id: str
    role: ReplicaRole = ReplicaRole.SYNCING


@dataclass(frozen=True)
class SlotChange:
    """One atomic change of one slot of a replicated region, decided on the slot at
    ``view``: the store applies it only if the slot is still at ``view``, and the slot's
    view becomes ``view + 1`` (on every copy it keeps)."""

    index: int
    view: int
    roles: Mapping[int, ReplicaRole] = field(default_factory=dict)  # copy -> new role
    remove: frozenset[int] = frozenset()                    # copies to forget
    add: NewCopy | None = None

    def describe(self) -> str:
        parts = [f"copy {c} -> {r}" for c, r in sorted(self.roles.items())]
        parts += [f"drop copy {c}" for c in sorted(self.remove)]
        if self.add is not None:
            parts.append(f"add copy {self.add.copy} on {self.add.server_id} ({self.add.role})")
        return f"slot {self.index} view {self.view} -> {self.view + 1}: {', '.join(parts) or 'bump'}"


def check_slot_change(region: RegionRecord, change: SlotChange, servers: Iterable[str] = ()) -> None:
    """Raise InvalidArgument unless ``change`` fits ``region`` (a region with that
    slot; known copies; known roles; one primary at most after it; a new copy with an
    unused copy number on a known server holding no copy of the slot). An unreplicated
    slot changes only while a move gives it a second copy (:mod:`.moves`)."""
    copies = {e.copy: e for e in region.copies_of(change.index)}
    if not copies:
        raise InvalidArgument(f"region {region.name!r} has no slot {change.index}")
    unknown = (set(change.roles) | set(change.remove)) - set(copies)
    if unknown:
        raise InvalidArgument(f"slot {change.index} of {region.name!r} has no copy {sorted(unknown)}")
    if any(r not in ASSIGNABLE for r in change.roles.values()):
        raise InvalidArgument(f"a copy's role is one of {', '.join(sorted(ASSIGNABLE))}")
    after = {c: change.roles.get(c, e.role) for c, e in copies.items() if c not in change.remove}
    if change.add is not None:
        if change.add.copy in copies or change.add.copy < 0:
            raise InvalidArgument(f"copy {change.add.copy} of slot {change.index} exists")
        if change.add.server_id in {e.server_id for e in copies.values()}:
            raise InvalidArgument(f"server {change.add.server_id} holds a copy of slot {change.index}")
        known = set(servers)
        if known and change.add.server_id not in known:
            raise InvalidArgument(f"no memory server {change.add.server_id!r}")
        after[change.add.copy] = change.add.role
    if sum(r == ReplicaRole.PRIMARY for r in after.values()) > 1:
        raise InvalidArgument(f"slot {change.index} of {region.name!r} would have two primaries")


# -- rules both state backends share --------------------------------------------------------
_UID = re.compile(r"[0-9a-f]{32}")
DELETE_MEMORY_SECONDS = 3600.0  # how long a done delete is remembered for its retries


def check_request_id(request_id: str) -> str:
    """A delete's request id: "" (none) or 32 lowercase hex digits. Raises InvalidArgument."""
    if request_id and (not isinstance(request_id, str) or not _UID.fullmatch(request_id)):
        raise InvalidArgument(f"a request id is 32 lowercase hex digits, not {request_id!r}")
    return request_id


MAX_LEASE_SECONDS = 7 * 24 * 3600.0   # the longest owner lease


def check_lease(owner: str, seconds: float) -> str:
    """An owner lease's owner (32 lowercase hex digits, the client's) and length (more
    than 0, at most :data:`MAX_LEASE_SECONDS`). Raises InvalidArgument."""
    if not isinstance(owner, str) or not _UID.fullmatch(owner):
        raise InvalidArgument(f"a lease's owner is 32 lowercase hex digits, not {owner!r}")
    if not (isinstance(seconds, (int, float)) and 0 < seconds <= MAX_LEASE_SECONDS):
        raise InvalidArgument(f"a lease lasts more than 0 and at most {MAX_LEASE_SECONDS:g} seconds, "
                              f"not {seconds!r}")
    return owner


def check_uid(uid: str) -> str:
    """A new region's uid: the caller's (32 lowercase hex digits, so that a retried create
    is known by it) or, for "", a fresh one. Raises InvalidArgument."""
    if not uid:
        return uuid.uuid4().hex
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise InvalidArgument(f"a region uid is 32 lowercase hex digits, not {uid!r}")
    return uid


def check_replicas(replicas: int) -> int:
    """A region's copy count: 0 (one) or 1 to :data:`MAX_REPLICAS`. Raises InvalidArgument."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be 1 to {MAX_REPLICAS} (0: one copy), not {replicas!r}")
    return max(1, replicas)


MAX_SERVERS = 1 << 16   # the most servers a region may be spread over


@dataclass(frozen=True)
class CreateRequest:
    """A region's create request, from the servicer through the region creator to the
    store: sizes in bytes, 0 or "" meaning the default. The stores plan from it once
    :func:`check_create` has checked and normalized it."""

    name: str
    size: int                               # bytes
    _: KW_ONLY
    placement: str = ""                     # striped (""), layered or single
    stripe_unit: int = 0                    # bytes (0: the default)
    num_servers: int = 0                    # 0: all
    segment_sizes: tuple[int, ...] = ()     # bytes (layered only)
    persistent: bool = False
    uid: str = ""                 # the caller's uid for the region: a retry with it gets the region it made
    replicas: int = 0             # copies of every byte on distinct servers (0 or 1: one)
    server_weights: tuple[tuple[str, float], ...] = ()   # layered: (server id, weight) pairs
    owner: str = ""               # with lease_seconds: whose lease keeps the region
    lease_seconds: float = 0.0    # > 0: deleted once the owner renewed nothing for this long

    def plan(self, free: Mapping[str, int], hosts: Mapping[str, str]) -> tuple[Layout, list[list[str]]]:
        """The layout and each slot's servers (copy 0 first), from each candidate
        server's free bytes and host (:func:`smb_protocol.placement.plan_replicated`)."""
        return placement_mod.plan_replicated(
            self.size, self.placement, free, self.replicas, hosts, stripe_unit=self.stripe_unit,
            num_servers=self.num_servers, segment_sizes=list(self.segment_sizes),
            weights=dict(self.server_weights) or None)


def check_create(req: CreateRequest) -> CreateRequest:
    """``req`` checked and normalized (a fresh uid for "", one copy for ``replicas`` 0,
    ``striped`` for no placement). Raises InvalidArgument."""
    uid = check_uid(req.uid)
    replicas = check_replicas(req.replicas)
    check_region_name(req.name)
    if req.size <= 0:
        raise InvalidArgument(f"region size must be positive, got {req.size} bytes")
    size = check_bytes("region size", req.size, 1)
    stripe_unit = check_bytes("stripe unit", req.stripe_unit)
    sizes = tuple(int(check_bytes("a segment size", s)) for s in req.segment_sizes)
    if not 0 <= int(req.num_servers) <= MAX_SERVERS:
        raise InvalidArgument(f"num_servers must be 0 (all) to {MAX_SERVERS}, got {req.num_servers}")
    placement = req.placement or "striped"
    if placement != "layered" and sizes:
        raise InvalidArgument(f"segment sizes are only for layered placement, not {placement!r}")
    return replace(req, uid=uid, size=int(size), placement=placement, stripe_unit=int(stripe_unit),
                   num_servers=int(req.num_servers), segment_sizes=sizes, persistent=bool(req.persistent),
                   replicas=replicas)


def region_state(stored: str, extents: Sequence[ExtentRecord], replicas: int = 1) -> str:
    """The state a client sees (``creating`` stays ``creating``).

    Unreplicated: ``lost`` once an extent is lost, ``degraded`` while a server holding
    one is down, else ``ready``. Replicated: ``lost`` when some slot has no un-lost copy
    in role primary or backup (a copy on a down server may come back); ``degraded``
    when any copy is dead (down or lost), syncing or stale, or a slot has fewer than
    ``replicas`` in-sync copies; else ``ready``.
    """
    if stored != "ready":
        return stored
    if replicas <= 1:   # a move's second copy is not part of what clients use
        extents = [e for e in extents if e.role in (ReplicaRole.NONE, ReplicaRole.PRIMARY)]
        if any(e.lost for e in extents):
            return "lost"
        if any(e.server_state == "down" for e in extents):
            return "degraded"
        return stored
    slots: dict[int, list[ExtentRecord]] = {}
    for e in extents:
        slots.setdefault(e.index, []).append(e)
    if any(not any(e.role in IN_SYNC and not e.lost for e in copies) for copies in slots.values()):
        return "lost"
    if any(e.dead or e.role in (ReplicaRole.SYNCING, ReplicaRole.STALE) for e in extents):
        return "degraded"
    if any(sum(e.in_sync for e in copies) < replicas for copies in slots.values()):
        return "degraded"
    return stored


@dataclass(frozen=True)
class DeletedRegion:
    """What a done delete leaves behind for its retries: the region's uid and where its
    extents were (server id, extent id, gRPC address), so that a delete repeated at a
    new leader frees what the old one may not have freed before it died."""

    uid: str
    extents: tuple[tuple[str, int, str], ...] = ()

    @classmethod
    def of(cls, region: RegionRecord) -> DeletedRegion:
        return cls(region.uid, tuple((e.server_id, e.extent_id, e.grpc_address) for e in region.extents))

    def dump(self, name: str) -> str:
        """JSON with the region's name (what the stores keep)."""
        return json.dumps({"name": name, "uid": self.uid, "extents": [list(e) for e in self.extents]})

    @classmethod
    def load(cls, text: str) -> tuple[str, DeletedRegion]:
        """(name, record) of :meth:`dump`'s JSON; a bare name (an older controller's
        record) has no extents."""
        try:
            doc = json.loads(text)
        except ValueError:
            return text, cls("")
        if not isinstance(doc, dict):
            return text, cls("")
        return str(doc["name"]), cls(str(doc.get("uid", "")),
                                     tuple((str(s), int(e), str(a)) for s, e, a in doc.get("extents", [])))

    def records(self) -> list[ExtentRecord]:
        """The extents as records :meth:`.creation.Creation.release_all` takes."""
        return [ExtentRecord(extent_id=e, index=0, server_id=s, length=0, grpc_address=a)
                for s, e, a in self.extents]


def find_orphans(server_id: str, known: Mapping[int, tuple[str, str]], held: Iterable[HeldExtent],
                 grace_seconds: float) -> list[int]:
    """Held extents that ``known`` (extent id -> (region uid, region state) of the
    extents placed on the server) does not account for, once held ``grace_seconds``."""
    orphans = []
    for h in held:
        entry = known.get(h.extent_id)
        if entry is not None and (not h.region_uid or h.region_uid == entry[0]):
            continue
        if h.age_seconds >= grace_seconds:
            orphans.append(h.extent_id)
    if orphans:
        log.info("server %s holds %d orphan extent(s): %s", server_id, len(orphans),
                 ", ".join(map(str, orphans[:10])))
    return orphans


def initial_role(replicas: int, copy: int) -> tuple[ReplicaRole, int]:
    """(role, view) of copy ``copy`` of a new region's slot: copy 0 is the primary, the
    others backups, all at view 1; ("", 0) in an unreplicated region."""
    if replicas <= 1:
        return ReplicaRole.NONE, 0
    return (ReplicaRole.PRIMARY if copy == 0 else ReplicaRole.BACKUP), 1
