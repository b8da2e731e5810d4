"""The rebalance an admin asks for (``smb rebalance``), kept in the leader's memory: the
byte moves of :func:`.moves.plan_rebalance` one at a time, then the role swaps of
:func:`.heads.plan_heads`; the repair pass carries both out (:mod:`.repair`).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from .heads import Swap, plan_heads, swap_state
from .moves import Move, bytes_leaving, plan_rebalance, syncing
from .records import RegionRecord, ServerRecord


class Rebalancer:
    """The rebalance an admin asked for (``Rebalance``): one move at a time, the next
    one started once the bytes moved since the start average at most
    ``bytes_per_second`` (0: at once); once no byte is left to move and every copy is
    in step, the role swaps of :func:`.heads.plan_heads` (all at once: they copy nothing),
    planned again until none is left. Kept in the
    leader's memory: a move in flight when the leader dies is finished by the next
    one (over-replication, :mod:`.moves`); the admin's next ``Rebalance`` call, which the
    command repeats until done, resumes planning. Thread-safe."""

    def __init__(self) -> None:
        self.active = False
        self.rate = 0.0
        self.bytes_left = 0        # what a rebalance still has to move (last pass)
        self.leaving_bytes = 0     # what every move, evacuations included, still has to copy
        self.moved = 0             # bytes this rebalance moved
        self.swapped = 0           # role swaps this rebalance made
        self._moving: dict[int, Move] = {}
        self._swaps: dict[int, Swap] = {}   # extent id of the copy to head its slot -> swap
        self._started = 0.0
        self._lock = threading.Lock()

    def start(self, bytes_per_second: float, now: float) -> None:
        """Start (or go on with, at a new rate) a rebalance."""
        with self._lock:
            if not self.active:
                self.moved, self.swapped, self._started = 0, 0, now
            self.active, self.rate = True, max(0.0, float(bytes_per_second))

    def stop(self) -> None:
        """Start no more moves (the one copying finishes)."""
        with self._lock:
            self.active = False

    def forget(self) -> None:
        """Leadership changed: no rebalance, no moves picked (a move whose copy is in
        step already is finished by over-replication)."""
        with self._lock:
            self.active = False
            self._moving.clear()
            self._swaps.clear()

    def running(self) -> bool:
        """Moves or swaps are planned or under way."""
        with self._lock:
            return self.active or bool(self._moving) or bool(self._swaps)

    def picked(self) -> dict[int, str]:
        """The moves in flight: extent id -> target server."""
        with self._lock:
            return {eid: m.target for eid, m in self._moving.items()}

    def swapping(self) -> dict[int, Swap]:
        """The role swaps in flight: extent id of the copy to become its slot's primary
        -> the swap."""
        with self._lock:
            return dict(self._swaps)

    def update(self, regions: Sequence[RegionRecord], servers: Sequence[ServerRecord],
               now: float) -> dict[int, str]:
        """A pass's view: finished moves and swaps forgotten, the next move picked when
        it is due, or the swaps once nothing is left to move; returns :meth:`picked`."""
        present = {e.extent_id for r in regions for e in r.extents}
        by_id = {s.server_id: s for s in servers}
        with self._lock:
            for eid, m in list(self._moving.items()):
                if eid not in present:
                    del self._moving[eid]
                    self.moved += m.length
            for eid in list(self._swaps):
                done = swap_state(regions, eid)
                if done != "pending":
                    del self._swaps[eid]
                    self.swapped += done == "done"
            due = self.rate <= 0 or now >= self._started + self.moved / self.rate
            plan = plan_rebalance(servers, regions) if self.active else []
            if self.active and not plan and not self._moving and not self._swaps \
                    and not syncing(regions, by_id):
                swaps = plan_heads(servers, regions)
                self._swaps = {s.extent_id: s for s in swaps}
                if not swaps:
                    self.active = False   # done: nothing to move or swap once every copy is in step
            if self.active and plan and not self._moving and due:
                self._moving[plan[0].extent_id] = plan[0]
            self.bytes_left = sum(m.length for m in plan)
            moving = {eid: m.target for eid, m in self._moving.items()}
        self.leaving_bytes = bytes_leaving(regions, by_id, moving)
        return moving
