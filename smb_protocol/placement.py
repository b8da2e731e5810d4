"""Region layout: the pure mapping from region bytes to extents.

Shared by the controller (to size extents and pick servers) and the client (to turn a
region offset into requests against extents). No I/O here.

Placements:

- ``striped``: stripes of ``stripe_unit`` bytes dealt round-robin over ``k`` extents;
  stripe ``i`` lives on extent ``i % k`` at extent offset ``(i // k) * stripe_unit``.
- ``layered``: one segment per tensor/layer, each whole on one extent; an extent holds
  its segments back to back in region order.
- ``single``: one extent holds everything.

A ``layered`` region may name its servers with weights (``weights`` of :func:`plan`,
server id -> weight; ``server_weights`` of a create request): its segments then go to
those servers only, each server's bytes in proportion to its weight
(:func:`assign_weighted`).
:func:`chunk_shares` derives such weights for a collective from where the workers
run (docs/architecture.md, Collectives, placement).
"""
from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument, OutOfMemory, OutOfRange
from .units import format_bytes

MAX_BYTES = (1 << 63) - 1   # the largest size, offset or capacity: 64-bit on the wire and in SQLite


def check_bytes(what: str, value: object, minimum: int = 0) -> int:
    """``value`` if it is a whole number of bytes from ``minimum`` to :data:`MAX_BYTES`;
    InvalidArgument saying what is allowed otherwise. Client and controller both use it."""
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_BYTES:
        raise InvalidArgument(f"{what} must be a whole number of bytes, at least {minimum} and "
                              f"below 2**63 (at most 2^63-1), not {value!r}")
    return value

DEFAULT_STRIPE_UNIT = 1 << 20  # bytes
PLACEMENTS = ("striped", "layered", "single")
MAX_REPLICAS = 3               # copies of every byte a region may ask for


@dataclass(frozen=True)
class Piece:
    """A contiguous byte range of the region that lies contiguously on one extent."""

    extent: int          # index into the region's extent list
    extent_offset: int   # bytes
    region_offset: int   # bytes
    length: int          # bytes


@dataclass
class Run:
    """Pieces that are contiguous on one extent (one request), in region order."""

    extent: int
    extent_offset: int
    length: int
    parts: list[tuple[int, int]] = field(default_factory=list)  # (region_offset, length)


@dataclass(frozen=True)
class ExtentPlace:
    """Where one extent of a region lives, as the controller reports it."""

    extent_id: int
    server_id: str
    length: int          # bytes
    grpc_address: str
    host_id: str
    endpoints: tuple[str, ...]   # data-plane URIs the server offers
    server_state: str
    index: int = 0       # the layout slot it holds
    copy: int = 0        # which copy of the slot (replicated regions)
    role: str = ""       # a ReplicaRole value (smb_protocol.replicas), kept as text: a newer role reads as itself

    @classmethod
    def from_message(cls, e: Any) -> ExtentPlace:
        """From a protobuf ``ExtentRef`` (or anything with the same fields; the replica
        fields default when absent)."""
        return cls(e.extent_id, e.server_id, e.length, e.grpc_address, e.host_id,
                   tuple(e.endpoints), e.server_state, int(getattr(e, "index", 0)),
                   int(getattr(e, "copy", 0)), str(getattr(e, "role", "")))


@dataclass(frozen=True)
class Layout:
    kind: str
    size: int
    extent_lengths: tuple[int, ...]
    stripe_unit: int = 0
    segment_sizes: tuple[int, ...] = ()
    segment_extents: tuple[int, ...] = ()

    # -- construction -------------------------------------------------------------
    @classmethod
    def striped(cls, size: int, stripe_unit: int, num_extents: int) -> Layout:
        _check_size(size)
        if stripe_unit <= 0:
            raise InvalidArgument(f"stripe unit must be positive, got {stripe_unit}")
        if num_extents <= 0:
            raise InvalidArgument(f"need at least one server, got {num_extents}")
        stripes = -(-size // stripe_unit)
        k = min(num_extents, stripes)
        lengths = []
        for j in range(k):
            count = len(range(j, stripes, k))
            length = count * stripe_unit
            if (stripes - 1) % k == j:  # this extent holds the short last stripe
                length -= stripes * stripe_unit - size
            lengths.append(length)
        return cls("striped", size, tuple(lengths), stripe_unit=stripe_unit)

    @classmethod
    def layered(cls, segment_sizes: Sequence[int], segment_extents: Sequence[int]) -> Layout:
        if not segment_sizes:
            raise InvalidArgument("layered placement needs segment sizes")
        if len(segment_sizes) != len(segment_extents):
            raise InvalidArgument("one extent index per segment expected")
        if any(s <= 0 for s in segment_sizes):
            raise InvalidArgument("segment sizes must be positive")
        k = max(segment_extents) + 1
        if sorted(set(segment_extents)) != list(range(k)):
            raise InvalidArgument("segment extents must use every index from 0 without gaps")
        lengths = [0] * k
        for s, e in zip(segment_sizes, segment_extents, strict=True):
            lengths[e] += s
        return cls("layered", sum(segment_sizes), tuple(lengths),
                   segment_sizes=tuple(segment_sizes), segment_extents=tuple(segment_extents))

    @classmethod
    def single(cls, size: int) -> Layout:
        _check_size(size)
        return cls("single", size, (size,))

    # -- mapping ------------------------------------------------------------------
    def check_range(self, offset: int, length: int) -> None:
        """OutOfRange unless ``[offset, offset+length)`` lies in the region;
        InvalidArgument when either is not a whole number (of bytes)."""
        try:
            offset, length = operator.index(offset), operator.index(length)
        except TypeError:
            raise InvalidArgument(f"offset and length are whole numbers of bytes, not {offset!r} "
                                  f"and {length!r}") from None
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfRange(
                f"range [{offset}, {offset + length}) outside region of {self.size} bytes")

    def map(self, offset: int, length: int) -> list[Piece]:
        """The pieces of ``[offset, offset+length)`` in region order."""
        self.check_range(offset, length)
        if length == 0:
            return []
        if self.kind == "striped":
            return self._map_striped(offset, length)
        if self.kind == "layered":
            return self._map_layered(offset, length)
        return [Piece(0, offset, offset, length)]

    def _map_striped(self, offset: int, length: int) -> list[Piece]:
        unit, k = self.stripe_unit, len(self.extent_lengths)
        pieces = []
        pos, end = offset, offset + length
        while pos < end:
            i, within = divmod(pos, unit)
            n = min(unit - within, end - pos)
            pieces.append(Piece(i % k, (i // k) * unit + within, pos, n))
            pos += n
        return pieces

    def _segment_tables(self) -> tuple[list[int], list[int]]:
        starts, ext_offsets, fill = [], [], [0] * len(self.extent_lengths)
        pos = 0
        for s, e in zip(self.segment_sizes, self.segment_extents, strict=True):
            starts.append(pos)
            ext_offsets.append(fill[e])
            fill[e] += s
            pos += s
        return starts, ext_offsets

    def _map_layered(self, offset: int, length: int) -> list[Piece]:
        starts, ext_offsets = self._segment_tables()
        pieces = []
        pos, end = offset, offset + length
        s = bisect.bisect_right(starts, pos) - 1
        while pos < end:
            within = pos - starts[s]
            n = min(self.segment_sizes[s] - within, end - pos)
            pieces.append(Piece(self.segment_extents[s], ext_offsets[s] + within, pos, n))
            pos += n
            s += 1
        return pieces

    def runs(self, offset: int, length: int) -> list[Run]:
        """Pieces merged into one request per contiguous extent range."""
        out: list[Run] = []
        last: dict[int, Run] = {}
        for p in self.map(offset, length):
            run = last.get(p.extent)
            if run is not None and run.extent_offset + run.length == p.extent_offset:
                run.length += p.length
                run.parts.append((p.region_offset, p.length))
                continue
            run = Run(p.extent, p.extent_offset, p.length, [(p.region_offset, p.length)])
            last[p.extent] = run
            out.append(run)
        return out

    def segment_offsets(self) -> list[int]:
        """Region offset of every layered segment."""
        return self._segment_tables()[0]


def split_runs(runs: Sequence[Run], chunk: int, align: int = 1) -> list[Run]:
    """Cut every run longer than ``chunk`` bytes into runs of at most that many (rounded
    down to a multiple of ``align`` bytes, at least ``align``), so that several
    connections can carry one long run. Region order and coverage are kept."""
    if chunk <= 0 or align <= 0:
        raise InvalidArgument(f"chunk ({chunk}) and align ({align}) must be positive numbers of bytes")
    chunk = max(align, chunk - chunk % align)
    out: list[Run] = []
    for run in runs:
        if run.length <= chunk:
            out.append(run)
            continue
        parts = list(run.parts)
        pos = 0
        while pos < run.length:
            n = min(chunk, run.length - pos)
            sub = Run(run.extent, run.extent_offset + pos, n, [])
            need = n
            while need:
                ro, pl = parts[0]
                take = min(pl, need)
                sub.parts.append((ro, take))
                need -= take
                if take == pl:
                    parts.pop(0)
                else:
                    parts[0] = (ro + take, pl - take)
            out.append(sub)
            pos += n
    return out


def _check_size(size: int) -> None:
    if size <= 0:
        raise InvalidArgument(f"region size must be positive, got {size}")


def assign_segments(segment_sizes: Sequence[int], num_extents: int) -> list[int]:
    """Deal segments to extents, each to the least-loaded so far (region order kept)."""
    k = max(1, min(num_extents, len(segment_sizes)))
    load = [0] * k
    order = sorted(range(len(segment_sizes)), key=lambda i: -segment_sizes[i])
    assignment = [0] * len(segment_sizes)
    for i in order:  # largest first balances best
        e = min(range(k), key=lambda j: (load[j], j))
        assignment[i] = e
        load[e] += segment_sizes[i]
    used = sorted(set(assignment))  # renumber so that indices have no gaps
    renumber = {e: n for n, e in enumerate(used)}
    return [renumber[e] for e in assignment]


def plan(size: int, placement: str, free: Mapping[str, int], *,
         stripe_unit: int = 0, num_servers: int = 0,
         segment_sizes: Sequence[int] = (),
         weights: Mapping[str, float] | None = None) -> tuple[Layout, list[str]]:
    """Choose servers and a layout for a new region.

    ``free`` maps server id to free bytes, for servers that may take new extents.
    ``weights`` (layered only; server id -> weight, :func:`check_weights`): the
    segments go to those servers, each server's bytes in proportion to its weight.
    Returns the layout and the server id of every extent. Raises :class:`OutOfMemory`
    with the numbers when the region does not fit.
    """
    placement = placement or "striped"
    if weights:
        if placement != "layered":
            raise InvalidArgument(f"server weights are for layered placement, not {placement!r}")
        return _plan_weighted(size, check_weights(weights), free, num_servers, segment_sizes)
    if placement not in PLACEMENTS:
        raise InvalidArgument(f"unknown placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if num_servers < 0:
        raise InvalidArgument("num_servers must not be negative")
    if not free:
        raise OutOfMemory(f"no memory server is available for a region of {format_bytes(size)}; "
                          "`smb status` shows the servers and their state")
    by_free = sorted(free, key=lambda s: (-free[s], s))
    if num_servers > len(by_free):
        raise OutOfMemory(f"{num_servers} servers asked for, only {len(by_free)} available")
    k = num_servers or len(by_free)
    if placement == "single":
        layout = Layout.single(size)
    elif placement == "striped":
        layout = Layout.striped(size, stripe_unit or DEFAULT_STRIPE_UNIT, k)
    else:
        if segment_sizes and sum(segment_sizes) != size:
            raise InvalidArgument(
                f"segment sizes add up to {sum(segment_sizes)} bytes, region size is {size}")
        segs = list(segment_sizes) or [size]
        layout = Layout.layered(segs, assign_segments(segs, k))
    # the largest extents go to the servers with the most free memory
    order = sorted(range(len(layout.extent_lengths)), key=lambda e: -layout.extent_lengths[e])
    servers = [""] * len(order)
    for e, sid in zip(order, by_free, strict=False):   # the k servers with most free memory
        servers[e] = sid
    short = [(servers[e], layout.extent_lengths[e], free[servers[e]])
             for e in order if layout.extent_lengths[e] > free[servers[e]]]
    if short:
        detail = "; ".join(_shortfall(s, need, have) for s, need, have in short)
        raise OutOfMemory(
            f"region of {format_bytes(size)} does not fit ({placement} over {len(order)} servers): "
            f"{detail}; total free {format_bytes(sum(free.values()))}; ask for less, spread it "
            "over more servers, or free memory (`smb region ls`, `smb region rm`)")
    return layout, servers


def _shortfall(server: str, need: int, have: int) -> str:
    """"server s needs 8.0 MiB, has 6.0 MiB free", in bytes where the units round the
    difference away."""
    if format_bytes(need) == format_bytes(have):
        return f"server {server} needs {need} bytes, has {have} bytes free"
    return f"server {server} needs {format_bytes(need)}, has {format_bytes(have)} free"


def _plan_weighted(size: int, weights: Mapping[str, float], free: Mapping[str, int],
                   num_servers: int, segment_sizes: Sequence[int]) -> tuple[Layout, list[str]]:
    """:func:`plan` for a layered region whose segments go to the servers of
    ``weights`` in proportion to their weights."""
    if num_servers:
        raise InvalidArgument("num_servers and server weights exclude each other: the weights name the servers")
    missing = sorted(s for s in weights if s not in free)
    if missing:
        raise OutOfMemory(f"server(s) {', '.join(missing)} asked for by the placement are not up "
                          f"(up: {', '.join(sorted(free)) or 'none'})")
    if segment_sizes and sum(segment_sizes) != size:
        raise InvalidArgument(
            f"segment sizes add up to {sum(segment_sizes)} bytes, region size is {size}")
    segs = list(segment_sizes) or [size]
    _check_size(size)
    ids = list(weights)
    chosen = assign_weighted(segs, [weights[sid] for sid in ids])
    used = sorted(set(chosen))
    renumber = {j: e for e, j in enumerate(used)}
    layout = Layout.layered(segs, [renumber[j] for j in chosen])
    servers = [ids[j] for j in used]
    short = [(sid, n, free[sid]) for sid, n in zip(servers, layout.extent_lengths, strict=True) if n > free[sid]]
    if short:
        detail = "; ".join(_shortfall(s, need, have) for s, need, have in short)
        raise OutOfMemory(f"region of {format_bytes(size)} does not fit (layered, weighted over {len(servers)} "
                          f"servers): {detail}")
    return layout, servers


# -- weighted placement -------------------------------------------------------------


def check_weights(weights: object) -> dict[str, float]:
    """``weights`` (server id -> weight) as a dict of floats if every weight is a finite
    number >= 0 and one is > 0; InvalidArgument otherwise."""
    if not isinstance(weights, Mapping) or not weights:
        raise InvalidArgument(f"server weights must map server ids to numbers, not {weights!r}")
    out: dict[str, float] = {}
    for sid, w in weights.items():
        if not isinstance(sid, str) or not sid:
            raise InvalidArgument(f"server weights: {sid!r} is not a server id")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise InvalidArgument(f"server weights: {sid} has weight {w!r}; weights are finite numbers >= 0")
        out[sid] = float(w)
    if not any(out.values()):
        raise InvalidArgument("server weights: at least one weight must be positive")
    return out


def assign_weighted(segment_sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """For every segment, the index into ``weights`` of the server it goes to: largest
    segment first, each to the server that would finish it first, ``(load + size) /
    weight`` (ties to the lower index; weight 0 takes nothing). A server of weight ``w``
    (of ``W`` in all, ``k`` servers weighing more than 0) ends with at most
    ``w / W × (bytes + k × largest segment)``."""
    if not any(w > 0 for w in weights):
        raise InvalidArgument("at least one weight must be positive")
    top = max(weights)
    scaled = [w / top for w in weights]   # tiny weights would make every finish time infinite
    live = [j for j, w in enumerate(scaled) if w > 0]   # one too small to count takes nothing
    load = [0] * len(weights)
    out = [0] * len(segment_sizes)
    for i in sorted(range(len(segment_sizes)), key=lambda i: -segment_sizes[i]):
        j = min(live, key=lambda j: ((load[j] + segment_sizes[i]) / scaled[j], j))
        out[i] = j
        load[j] += segment_sizes[i]
    return out


def chunk_shares(servers: Mapping[str, str], worker_hosts: Sequence[str],
                 links: Mapping[str, float] | None = None) -> dict[str, float]:
    """The share of a collective's bytes each memory server should sum, when the hosts'
    links are the bottleneck: ``servers`` maps server id -> host id, ``worker_hosts``
    holds the host id of every worker (repeats for several on one host), ``links`` the
    link capacity of a host (any unit; default 1 each). Shares add up to 1.

    Host ``h`` with ``m`` workers and servers summing a share ``x`` carries, each way
    and in units of the gradient, ``m + (n - 2m) x`` (:func:`host_loads`). The shares
    minimize the largest load / capacity: water-filling to a common time ``T``, a host
    taking ``x = (T·B - m) / (n - 2m)`` (0 where ``T·B < m``); a host with ``n <= 2m``
    (half the workers or more) gets cheaper with more and takes everything. Servers
    on one host split its share evenly. Derivation: docs/architecture.md.
    """
    n = len(worker_hosts)
    if not servers:
        raise InvalidArgument("chunk_shares needs at least one server")
    if n < 1:
        raise InvalidArgument("chunk_shares needs the host of at least one worker")
    links = links or {}
    workers: dict[str, int] = {}
    for h in worker_hosts:
        workers[h] = workers.get(h, 0) + 1
    capacity = {h: float(links.get(h, 1.0)) for h in {*servers.values(), *workers}}
    if any(not b > 0 or not math.isfinite(b) for b in capacity.values()):
        raise InvalidArgument(f"link capacities must be positive: {capacity}")
    hosts = sorted(set(servers.values()))
    host_share: dict[str, float] = {}
    free_hosts = [h for h in hosts if n - 2 * workers.get(h, 0) <= 0]
    if free_hosts:
        total = sum(capacity[h] for h in free_hosts)
        host_share = {h: capacity[h] / total for h in free_hosts}
    else:
        t = _water_level(hosts, workers, capacity, n)
        t = max(t, max(m / capacity[h] for h, m in workers.items()))   # no host beats its own workers' traffic
        raw = {h: max(0.0, (t * capacity[h] - workers.get(h, 0)) / (n - 2 * workers.get(h, 0))) for h in hosts}
        total = sum(raw.values())
        host_share = {h: x / total for h, x in raw.items()}
    per_host: dict[str, int] = {}
    for h in servers.values():
        per_host[h] = per_host.get(h, 0) + 1
    return {sid: host_share.get(h, 0.0) / per_host[h] for sid, h in servers.items()}


def _water_level(hosts: Sequence[str], workers: Mapping[str, int], capacity: Mapping[str, float],
                 n: int) -> float:
    """The time ``T`` at which the hosts' shares ``max(0, (T·B - m) / (n - 2m))`` add up
    to 1 (every host has ``n > 2m``)."""
    order = sorted(hosts, key=lambda h: workers.get(h, 0) / capacity[h])
    a = b = 0.0   # over the hosts taking a share: sum of B/c and of m/c; shares = T·a - b
    t = 0.0
    for i, h in enumerate(order):
        m, c = workers.get(h, 0), n - 2 * workers.get(h, 0)
        a += capacity[h] / c
        b += m / c
        t = (1 + b) / a
        nxt = order[i + 1] if i + 1 < len(order) else None
        if nxt is None or t <= workers.get(nxt, 0) / capacity[nxt]:
            break
    return t


def host_loads(shares: Mapping[str, float], servers: Mapping[str, str],
               worker_hosts: Sequence[str]) -> dict[str, float]:
    """What each host's link carries each way, in units of the gradient, when server
    ``s`` (on host ``servers[s]``) sums ``shares[s]`` of it and the workers run on
    ``worker_hosts``: ``m + (n - 2m) x`` for ``m`` workers and a share ``x`` on the
    host (pushes of the other hosts' workers in, its own workers' pulls of the rest)."""
    n = len(worker_hosts)
    workers: dict[str, int] = {}
    for h in worker_hosts:
        workers[h] = workers.get(h, 0) + 1
    share: dict[str, float] = {}
    for sid, x in shares.items():
        share[servers[sid]] = share.get(servers[sid], 0.0) + x
    return {h: workers.get(h, 0) + (n - 2 * workers.get(h, 0)) * share.get(h, 0.0)
            for h in sorted({*share, *workers})}


def plan_replicated(size: int, placement: str, free: Mapping[str, int], replicas: int,
                    hosts: Mapping[str, str] | None = None, *, stripe_unit: int = 0,
                    num_servers: int = 0, segment_sizes: Sequence[int] = (),
                    weights: Mapping[str, float] | None = None) -> tuple[Layout, list[list[str]]]:
    """Choose servers and a layout for a region with ``replicas`` copies of every slot.

    Returns the layout and, per slot in layout order, the server of each copy (copy 0,
    the primary, first). The slots and primaries are those of :func:`plan` (primaries
    balanced over the servers); each further copy goes, largest slot first, to a server
    holding no copy of the slot, preferring a host (``hosts``: server id -> host id)
    that holds none either, then the most free bytes left. ``replicas`` 1 is
    :func:`plan`'s answer. Raises InvalidArgument for ``replicas`` outside 1 to
    :data:`MAX_REPLICAS`, OutOfMemory (with the numbers) with fewer servers than
    copies or too little free memory.
    """
    if not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be 1 to {MAX_REPLICAS}, not {replicas!r}")
    if replicas > 1 and len(free) < replicas:
        raise OutOfMemory(f"{replicas} copies of every byte need {replicas} memory servers, "
                          f"only {len(free)} available")
    layout, primaries = plan(size, placement, free, stripe_unit=stripe_unit,
                             num_servers=num_servers, segment_sizes=segment_sizes, weights=weights)
    hosts = hosts or {}
    left = dict(free)
    for e, sid in enumerate(primaries):
        left[sid] -= layout.extent_lengths[e]
    copies = [[sid] for sid in primaries]
    order = sorted(range(len(primaries)), key=lambda e: -layout.extent_lengths[e])
    for _ in range(1, replicas):
        for e in order:
            length = layout.extent_lengths[e]
            taken = set(copies[e])
            taken_hosts = {hosts.get(s, s) for s in taken}
            fits = [s for s in left if s not in taken and left[s] >= length]
            if not fits:
                most = max((left[s] for s in left if s not in taken), default=0)
                raise OutOfMemory(
                    f"region of {format_bytes(size)} with {replicas} copies does not fit ({placement} "
                    f"over {len(primaries)} servers): a copy of {format_bytes(length)} finds at most "
                    f"{format_bytes(most)} free on a server without a copy of it; total free "
                    f"{format_bytes(sum(free.values()))}")
            best = min(fits, key=lambda s: (hosts.get(s, s) in taken_hosts, -left[s], s))
            left[best] -= length
            copies[e].append(best)
    return layout, copies
