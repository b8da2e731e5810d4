"""The controller's records (servers, regions, extents) and the checks on what callers
send; pure data, no database."""
from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from smb_client.errors import InvalidArgument
from smb_client.placement import Layout

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

    @property
    def free(self) -> int:
        """Bytes not yet placed (never negative)."""
        return max(0, self.capacity - self.used)


@dataclass(frozen=True)
class ExtentRecord:
    """One extent of a region as the controller keeps it: its place in the layout,
    its server and whether that server lost it. (Clients see
    :class:`smb_client.placement.ExtentPlace`.)"""

    extent_id: int
    index: int             # position in the region's layout
    server_id: str
    length: int            # bytes
    grpc_address: str = ""
    host_id: str = ""
    endpoints: tuple[str, ...] = ()
    server_state: str = ""  # up | down | draining
    lost: bool = False      # its server registered again without it


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
    extents: tuple[ExtentRecord, ...] = field(default=())  # in layout order

    @property
    def lost_servers(self) -> list[str]:
        """The servers that registered without some extent of this region (state ``lost``)."""
        return sorted({e.server_id for e in self.extents if e.lost})

    @property
    def extent_ids(self) -> list[int]:
        return [e.extent_id for e in self.extents]

    def layout(self) -> Layout:
        """The pure offset -> (extent, offset) mapping of this region."""
        return Layout(self.placement, self.size, tuple(e.length for e in self.extents),
                      stripe_unit=self.stripe_unit, segment_sizes=self.segment_sizes,
                      segment_extents=self.segment_extents)


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


def region_state(stored: str, extents: Sequence[ExtentRecord]) -> str:
    """The state a client sees: ``lost`` once an extent is lost, ``degraded`` while a
    server holding one is down, else the stored ``creating``/``ready``."""
    if stored == "ready" and any(e.lost for e in extents):
        return "lost"
    if stored == "ready" and any(e.server_state == "down" for e in extents):
        return "degraded"
    return stored


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
