"""Moving copies between memory servers while clients use them: evacuating a server and
rebalancing the pool. Pure decisions; the repair pass carries them out (:mod:`.repair`).

A move is made of replica-set changes the repair pass already makes for a dead copy:

1. a new copy of the slot on the target server, filled from the slot's primary while
   clients keep writing (a sync: forwarded mutations plus a chunked copy, ending with
   the primary's exactly-once entries, ``SEED``);
2. once it is in step, the copy that leaves goes: a backup is dropped; a primary is
   replaced by promoting an in-step copy that stays, gracefully where it can: the old
   primary is configured a backup first, which drains its forwarding, so the other
   copies that stay are not copied again (:meth:`.repair.RepairManager._drain`); else
   the backups are configured at the new view first, which fences the old primary (a
   mutation it had not forwarded yet is refused and retried by its client at the new
   primary, with the same number), and they are copied again;
3. the dropped copy is released on its server.

An unreplicated slot is a replica set of one: for its move its extent becomes the
primary of two copies (so every mutation sent through the server is forwarded to the
new copy), and the copy that stays is configured unreplicated again afterwards.

Nothing about a move is stored besides the replica set itself. Which copies leave is
decided again on every pass from the servers' drain flags (``evacuating``), from the
moves the controller has picked (``moving``: extent id -> target server), and from
over-replication: a slot with more in-step copies than it needs (a move whose new copy
is in step, its controller gone before it dropped the old one) gives up the extra copies
on the fullest servers. So a new leader finishes a move it did not start.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from smb_protocol.errors import InvalidArgument, ServerNotFound
from smb_protocol.replicas import IN_SYNC, ReplicaRole

from .records import ExtentRecord, RegionRecord, ServerRecord

#: a server's stored drain flag: takes new extents | takes none | takes none and gives
#: every copy it holds away (the repair pass moves them)
DRAIN_NONE, DRAIN_STOP, DRAIN_EVACUATE = 0, 1, 2


def drain_flag(undrain: bool, evacuate: bool) -> int:
    """The drain flag a ``DrainServer`` call stores; InvalidArgument for both flags."""
    if undrain and evacuate:
        raise InvalidArgument("undrain and evacuate exclude each other")
    return DRAIN_NONE if undrain else DRAIN_EVACUATE if evacuate else DRAIN_STOP


def removed_error(server_id: str) -> ServerNotFound:
    """What a server removed from the pool (``smb server remove``) hears when it
    registers again: its daemon is still running, and must not rejoin unseen."""
    return ServerNotFound(f"memory server {server_id} was removed from the pool (smb server remove): stop "
                          "its daemon, or start it with a fresh state_dir to join as a new server")


def check_removable(server: ServerRecord) -> None:
    """Raise InvalidArgument unless ``server`` may leave the pool: drained (or down)
    and holding no extent, so that removing it forgets nothing."""
    if server.state == "up":
        raise InvalidArgument(f"server {server.server_id} is up: drain it first "
                              f"(smb server drain --evacuate --server-id {server.server_id})")
    if server.extents:
        raise InvalidArgument(f"server {server.server_id} still holds {server.extents} extent(s) "
                              f"({server.used} bytes): evacuate it first (smb server drain --evacuate)")



def holds_all(c: ExtentRecord) -> bool:
    """A live copy holding every acknowledged byte: a primary, a backup, or the one
    extent of an unreplicated slot."""
    return (c.role in IN_SYNC or c.role == ReplicaRole.NONE) and not c.dead


def head_of(copies: Sequence[ExtentRecord]) -> ExtentRecord | None:
    """The copy that orders a slot's mutations: its primary, or the one extent of an
    unreplicated slot; None when the slot has neither."""
    return next((c for c in copies if c.role == ReplicaRole.PRIMARY),
                next((c for c in copies if c.role == ReplicaRole.NONE), None))


def head_bytes(regions: Iterable[RegionRecord]) -> dict[str, int]:
    """Bytes of the slots each server heads (:func:`head_of`): where the slots' reads
    and mutations go, so where their traffic goes."""
    heads: dict[str, int] = {}
    for region in regions:
        for index in sorted({e.index for e in region.extents}):
            head = head_of(region.copies_of(index))
            if head is not None:
                heads[head.server_id] = heads.get(head.server_id, 0) + head.length
    return heads


def slots_headed(region: RegionRecord, but: int) -> dict[str, int]:
    """How many of ``region``'s slots each server heads, slot ``but`` left out."""
    out: dict[str, int] = {}
    for index in sorted({e.index for e in region.extents} - {but}):
        head = head_of(region.copies_of(index))
        if head is not None:
            out[head.server_id] = out.get(head.server_id, 0) + 1
    return out


def new_head(stay: Sequence[ExtentRecord], heads: Mapping[str, int],
             region_heads: Mapping[str, int] = {}) -> ExtentRecord:
    """The copy that becomes a slot's primary when its primary leaves: a backup on a
    server that is up, on the one heading the fewest of the region's other slots
    (``region_heads``, :func:`slots_headed`: a striped region's reads stay spread over
    as many servers as before), then the fewest bytes (``heads``), so that the traffic
    of a server that is emptied spreads over the others, a new server's included,
    instead of staying where the backups were."""
    return min(stay, key=lambda c: (c.server_state != "up", region_heads.get(c.server_id, 0),
                                    heads.get(c.server_id, 0), c.copy))


def leaving(region: RegionRecord, index: int, servers: Mapping[str, ServerRecord],
            moving: Mapping[int, str] = {}) -> frozenset[int]:
    """The copy numbers of slot ``index`` that are to leave it: in-step copies on an
    evacuating server or picked for a move, and, when more in-step copies stay than the
    region's ``replicas``, the extra ones on the fullest servers (a backup before the
    primary)."""
    full = [c for c in region.copies_of(index) if holds_all(c)]
    out = {c.copy for c in full
           if c.extent_id in moving or (c.server_id in servers and servers[c.server_id].evacuating)}
    stay = [c for c in full if c.copy not in out]
    extra = len(stay) - region.replicas
    if extra > 0:
        def fullest(c: ExtentRecord) -> tuple[int, bool, int]:
            used = servers[c.server_id].used if c.server_id in servers else 0
            return (-used, c.role == ReplicaRole.PRIMARY, c.copy)
        out |= {c.copy for c in sorted(stay, key=fullest)[:extra]}
    return frozenset(out)


def bytes_leaving(regions: Iterable[RegionRecord], servers: Mapping[str, ServerRecord],
                  moving: Mapping[int, str] = {}) -> int:
    """Bytes of every copy that is to leave its slot (what moves still have to copy)."""
    total = 0
    for region in regions:
        if region.state in ("creating", "lost"):
            continue
        for index in sorted({e.index for e in region.extents}):
            gone = leaving(region, index, servers, moving)
            total += sum(c.length for c in region.copies_of(index) if c.copy in gone)
    return total


def syncing(regions: Iterable[RegionRecord], servers: Mapping[str, ServerRecord]) -> bool:
    """Some copy on a server that is up is being brought in step (after a handover, the
    copies besides the new primary are): its slot cannot move until it is."""
    return any(c.role == ReplicaRole.SYNCING and c.server_id in servers and servers[c.server_id].state != "down"
               for r in regions if r.state in ("ready", "degraded") for c in r.extents)


#: a rebalance moves a copy that narrows a gap between two servers by at least this
#: fraction of it on its own, or copies that may move between them and together make
#: up :data:`WORTH_TOGETHER`'s fraction: every move costs a sync, and a primary's a
#: handover, which a few bytes do not pay for
WORTH_ALONE = 64
WORTH_TOGETHER = 8


@dataclass(frozen=True)
class Move:
    """One copy to move for a rebalance: extent ``extent_id`` (slot ``index`` of
    ``region``) from ``source`` to ``target``."""

    region: str
    index: int
    extent_id: int
    source: str
    target: str
    length: int


def plan_rebalance(servers: Sequence[ServerRecord], regions: Sequence[RegionRecord],
                   limit: int = 1 << 20) -> list[Move]:
    """The moves (at most ``limit``) that even out the bytes held by the servers that
    are up: repeatedly a copy from the fullest server to the emptiest one, as long as it
    narrows their gap (its length is below the gap), the emptiest holds no copy of its
    slot and has room, the move is worth its sync (the copy is at least
    1/:data:`WORTH_ALONE` of the gap, or the copies that may move between the pair make
    up 1/:data:`WORTH_TOGETHER` of it together: a 4 KB region does not move to narrow
    a 6 MB gap, a thousand of them do), and the move gathers no region: the target
    ends with at most the region's fair share of its copies (all its copies over the
    servers, rounded up) or no more than the source had (else the next pair of
    servers). Bytes are evened out only so far as a region's traffic stays spread: a
    region whose slots gathered on fewer servers would be served by fewer links. Among
    the fullest server's copies, one of a region with more slots there than on the
    emptiest goes first, so that a striped region's slots, and its traffic, spread too;
    among those, the one that leaves the bytes each server heads (:func:`head_bytes`:
    its slots' traffic) most even, taking into account which copy a moved primary's
    handover promotes (:func:`new_head`); then one of the region with the most such
    slots; then the longest. Only slots of ready regions whose copies are all in step
    move."""
    used = {s.server_id: s.used for s in servers if s.state == "up" and not s.evacuating}
    free = {s.server_id: s.free for s in servers if s.server_id in used}
    if len(used) < 2:
        return []
    where: dict[str, list[tuple[RegionRecord, ExtentRecord]]] = {sid: [] for sid in used}
    holders: dict[tuple[str, int], set[str]] = {}
    on: dict[tuple[str, str], int] = {}   # (region uid, server) -> its slots with a copy there
    ready = [r for r in regions if r.state == "ready"]
    heads = {sid: 0 for sid in used} | head_bytes(ready)
    for region in ready:
        for index in sorted({e.index for e in region.extents}):
            copies = region.copies_of(index)
            holders[(region.uid, index)] = {c.server_id for c in copies}
            for sid in holders[(region.uid, index)]:
                on[(region.uid, sid)] = on.get((region.uid, sid), 0) + 1
            if not all(holds_all(c) for c in copies):
                continue
            for c in copies:
                if c.server_id in where:
                    where[c.server_id].append((region, c))

    def head_after(region: RegionRecord, c: ExtentRecord, target: str) -> str:
        """The server heading ``c``'s slot once ``c`` moved to ``target``."""
        if c.role == ReplicaRole.NONE:
            return target
        head = head_of(region.copies_of(c.index))
        if head is None or head.copy != c.copy:
            return head.server_id if head is not None else ""
        stay = [o for o in region.copies_of(c.index) if o.copy != c.copy and o.server_id in used]
        if not stay:
            return target
        others = slots_headed(region, c.index)
        return min([target, *(o.server_id for o in stay)],
                   key=lambda s: (others.get(s, 0), heads.get(s, 0), s != target))

    def spread(region: RegionRecord, c: ExtentRecord, source: str, target: str) -> int:
        """How uneven the bytes the servers head are after the move (sum of squares)."""
        after = dict(heads)
        if c.role in (ReplicaRole.NONE, ReplicaRole.PRIMARY):
            after[source] = after.get(source, 0) - c.length
            head = head_after(region, c, target)
            after[head] = after.get(head, 0) + c.length
        return sum(v * v for sid, v in after.items() if sid in used)
    count = {r.uid: len(r.extents) for r in ready}   # copies of each region

    def gathers(region: RegionRecord, source: str, target: str) -> bool:
        """Whether moving a copy of ``region`` from ``source`` to ``target`` leaves the
        target more of its copies than both the fair share and what the source had."""
        fair = -(-count[region.uid] // len(used))
        after = on.get((region.uid, target), 0) + 1
        return after > fair and after > on.get((region.uid, source), 0)

    moves: list[Move] = []
    def widest() -> tuple[str, str, list[tuple[RegionRecord, ExtentRecord]]]:
        """The fullest server with a copy that may move to the emptiest server that may
        take one (a pair of servers whose slots all overlap, or where every move would
        gather a region, is passed over)."""
        for source in sorted(used, key=lambda s: (-used[s], s)):
            for target in sorted(used, key=lambda s: (used[s], s)):
                gap = used[source] - used[target]
                if gap <= 0:
                    break
                fits = [(r, c) for r, c in where[source] if c.length < gap and c.length <= free[target]
                        and target not in holders[(r.uid, c.index)] and not gathers(r, source, target)]
                worth = [(r, c) for r, c in fits if c.length * WORTH_ALONE >= gap]
                if worth:
                    return source, target, worth
                if sum(c.length for _, c in fits) * WORTH_TOGETHER >= gap:
                    return source, target, fits
        return "", "", []

    while len(moves) < limit:
        source, target, fits = widest()
        if not fits:
            return moves
        slots = {uid: on.get((uid, source), 0) - on.get((uid, target), 0) for uid in {r.uid for r, _ in fits}}
        region, c = max(fits, key=lambda rc: (slots[rc[0].uid] > 0, -spread(rc[0], rc[1], source, target),
                                              slots[rc[0].uid], rc[1].length, -rc[1].extent_id))
        moves.append(Move(region.name, c.index, c.extent_id, source, target, c.length))
        if c.role in (ReplicaRole.NONE, ReplicaRole.PRIMARY):
            head = head_after(region, c, target)
            heads[source] -= c.length
            heads[head] = heads.get(head, 0) + c.length
        where[source].remove((region, c))
        holders[(region.uid, c.index)] = (holders[(region.uid, c.index)] - {source}) | {target}
        on[(region.uid, source)] -= 1
        on[(region.uid, target)] = on.get((region.uid, target), 0) + 1
        used[source] -= c.length
        used[target] += c.length
        free[target] -= c.length
    return moves
