"""Evening each region's primaries (heads) out over the servers by role swaps: a backup
of a slot becomes its primary and the primary stays as a backup, without copying a byte
(the repair pass drains the old primary first, :mod:`.repair`). Pure decisions, as
:mod:`.moves`'s; the rebalance makes them once no byte is left to move
(:mod:`.rebalancer`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from smb_protocol.replicas import ReplicaRole

from .moves import WORTH_ALONE, head_bytes, head_of, holds_all
from .records import RegionRecord, ServerRecord


@dataclass(frozen=True)
class Swap:
    """One role swap for a rebalance: the in-step backup ``extent_id`` (on ``target``)
    of slot ``index`` of ``region`` becomes its primary in place of the one on
    ``source``, which stays as a backup. No byte is copied (the handover drains the old
    primary's forwarding first, :mod:`.repair`); ``length``: the slot's bytes, whose
    reads and mutations change server."""

    region: str
    index: int
    extent_id: int
    source: str
    target: str
    length: int


@dataclass
class _Slot:
    """A slot :func:`plan_heads` may swap: its head before and in the plan, its length
    (bytes) and the servers of its other in-step copies in the plan."""

    first: str
    head: str
    length: int
    backups: list[str]


def head_cap(slots: int, servers: int) -> int:
    """The most slots of a region of ``slots`` slots one of ``servers`` servers heads
    when its primaries are spread as evenly as the slot count allows."""
    return -(-slots // max(1, servers))


#: a role swap that evens the bytes the servers head across regions (once each
#: region's heads are even) is worth its handover when the slot is at least this
#: fraction of the gap it narrows (as :data:`WORTH_ALONE` for a move)
SWAP_WORTH = WORTH_ALONE
#: role swaps planned at most per call (a bound; a pool needs far fewer)
MAX_SWAPS = 4096


def plan_heads(servers: Sequence[ServerRecord], regions: Sequence[RegionRecord],
               limit: int = MAX_SWAPS) -> list[Swap]:
    """The role swaps (at most ``limit``) that even out the primaries of every ready
    replicated region over the servers that are up, without moving a byte. Only slots
    whose copies are all in step, headed by a server that is up, take part, and a slot's
    primary goes only to one of its backups on a server that is up.

    1. Each striped region's heads: while a server heads two slots more of the region
       than another could take (``h`` against ``h - 2`` or fewer), a chain of swaps
       moves one head along: the server heading the most hands a slot to a server
       holding its backup, which hands one of its own on if it heads too many itself,
       until a server heading at most ``h - 2`` takes one (the shortest chain; among
       equals the server heading the fewest bytes of every region ends it). Where the
       copies allow, no server then heads more than :func:`head_cap` of the region's
       slots, and every server heads within one of the others.
    2. Across regions: a slot's head goes to a backup's server heading fewer of the
       region's slots, or as many but one (so each region stays within one of even),
       when that narrows the gap between the two servers' head bytes
       (:func:`head_bytes`), the one that narrows it most first; a slot below
       1/:data:`SWAP_WORTH` of the gap stays (a handover pauses its clients).

    The plan swaps each slot at most once (a chain that passes a slot twice is folded
    into one swap, or none)."""
    live = {s.server_id for s in servers if s.state == "up" and not s.evacuating}
    if len(live) < 2:
        return []
    ready = [r for r in regions if r.state == "ready" and r.replicas > 1]
    totals = {sid: 0 for sid in live} | {sid: n for sid, n in head_bytes(regions).items() if sid in live}
    slots: dict[tuple[str, int], _Slot] = {}
    counts: dict[str, dict[str, int]] = {}    # region uid -> server -> slots it heads
    for region in sorted(ready, key=lambda r: r.name):
        count = counts[region.uid] = {sid: 0 for sid in live}
        for index in sorted({e.index for e in region.extents}):
            copies = region.copies_of(index)
            head = head_of(copies)
            if head is None or head.server_id not in live:
                continue
            count[head.server_id] += 1
            if head.role != ReplicaRole.PRIMARY or not all(holds_all(c) for c in copies):
                continue
            backups = sorted(c.server_id for c in copies
                             if c.role == ReplicaRole.BACKUP and c.server_id in live)
            if backups:
                slots[(region.uid, index)] = _Slot(head.server_id, head.server_id, head.length, backups)

    def swap(key: tuple[str, int], target: str) -> None:
        slot = slots[key]
        source = slot.head
        counts[key[0]][source] -= 1
        counts[key[0]][target] += 1
        totals[source] -= slot.length
        totals[target] += slot.length
        slot.backups = sorted((set(slot.backups) - {target}) | {source})
        slot.head = target

    for region in sorted(ready, key=lambda r: r.name):
        if region.placement != "striped":
            continue
        count = counts[region.uid]
        mine = [k for k in slots if k[0] == region.uid]
        while True:
            path = _head_chain(count, totals, {k: (slots[k].head, slots[k].backups) for k in mine})
            if not path:
                break
            for key, target in path:
                swap(key, target)
    for _ in range(len(slots)):
        best: tuple[int, tuple[str, int], str] | None = None
        for key, slot in slots.items():
            count = counts[key[0]]
            for target in slot.backups:
                gap = totals[slot.head] - totals[target]
                if count[target] >= count[slot.head] or slot.length >= gap or slot.length * SWAP_WORTH < gap:
                    continue
                gain = gap * gap - (gap - 2 * slot.length) ** 2
                if best is None or (gain, target) > (best[0], best[2]):
                    best = (gain, key, target)
        if best is None:
            break
        swap(best[1], best[2])
    by_uid = {r.uid: r for r in ready}
    out = []
    for (uid, index), slot in sorted(slots.items(), key=lambda kv: (by_uid[kv[0][0]].name, kv[0][1])):
        if slot.head != slot.first:
            new = next(c for c in by_uid[uid].copies_of(index) if c.server_id == slot.head)
            out.append(Swap(by_uid[uid].name, index, new.extent_id, slot.first, slot.head, slot.length))
    return out[:limit]


def _head_chain(count: Mapping[str, int], totals: Mapping[str, int],
                slots: Mapping[tuple[str, int], tuple[str, Sequence[str]]]) -> list[tuple[tuple[str, int], str]]:
    """The shortest chain of swaps (slot, new head) that moves one of a region's heads
    from a server heading the most of its slots to one heading at least two fewer
    (:func:`plan_heads`, step 1); [] when there is none. ``count``: slots each server
    heads; ``slots``: each movable slot's head and backups' servers."""
    top = max(count.values())
    by_head: dict[str, list[tuple[tuple[str, int], Sequence[str]]]] = {}
    for key, (head, backups) in sorted(slots.items()):
        by_head.setdefault(head, []).append((key, backups))
    start = sorted(s for s, n in count.items() if n == top)
    came: dict[str, tuple[str, tuple[str, int]] | None] = {s: None for s in start}
    frontier = start
    while frontier:
        ends: list[str] = []
        nxt: list[str] = []
        for server in frontier:
            for key, backups in by_head.get(server, []):
                for target in backups:
                    if target in came:
                        continue
                    came[target] = (server, key)
                    (ends if count[target] <= top - 2 else nxt).append(target)
        if ends:
            end = min(ends, key=lambda s: (count[s], totals[s], s))
            path = []
            at = end
            while came[at] is not None:
                server, key = came[at]   # type: ignore[misc]
                path.append((key, at))
                at = server
            return path[::-1]
        frontier = nxt
    return []


def swap_state(regions: Iterable[RegionRecord], extent_id: int) -> str:
    """Where the swap that makes copy ``extent_id`` its slot's primary stands: ``done``
    (it is the primary), ``pending`` (an in-step backup of a slot whose copies are all
    in step: it may still be made) or ``void`` (gone, or its slot changed otherwise)."""
    for region in regions:
        for e in region.extents:
            if e.extent_id != extent_id:
                continue
            if e.role == ReplicaRole.PRIMARY:
                return "done"
            copies = region.copies_of(e.index)
            ok = e.role == ReplicaRole.BACKUP and all(holds_all(c) for c in copies) and head_of(copies) is not None
            return "pending" if ok else "void"
    return "void"
