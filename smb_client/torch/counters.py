"""Shared iteration counters and aligned stopping.

Every worker publishes its finished iterations with ``fetch_add`` on its own int64
word (and, under the ``average`` rule, on a shared total that the same ``fetch_add``
returns); a *stop word* tells everybody when to stop. Rules:

* ``master``: stop when the master (rank 0) has done ``target`` iterations;
* ``fastest``: stop when any worker has done ``target`` iterations;
* ``average``: stop when the iterations of all workers add up to ``target × workers``.

Words of the counters region (int64, little-endian):

====  ===============================================================
0     stop word: 0 while running, else the iteration count at which
      the worker that fired the rule stopped
1     total iterations of all workers (``average`` rule)
2     workers that have finished
3     arrivals at the synchronous workers' barrier (only grows; see ``sync.py``)
8+r   iterations of worker ``r``
last  (the region's last ``workers`` words) arrivals of each synchronous worker at the
      step's waits, which name the missing workers of a stalled step (``sync.py``)
====  ===============================================================

Asynchronous workers stop as soon as they see a non-zero stop word. Workers that run
in lockstep (the synchronous scheme) pass ``lockstep=True``: they stop once their own
count reaches the stop word, so all of them stop after the same iteration even when
one reads the word a step later than another.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from smb_protocol.errors import InvalidArgument

from .store import COUNTER_WORDS

log = logging.getLogger(__name__)

STOP_WORD = 0
TOTAL_WORD = 1
FINISHED_WORD = 2
SYNC_BARRIER_WORD = 3


class StopRule(enum.StrEnum):
    MASTER = "master"
    FASTEST = "fastest"
    AVERAGE = "average"

    @classmethod
    def parse(cls, value: str | StopRule) -> StopRule:
        """The rule named ``value``; InvalidArgument naming the known ones."""
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"unknown stop rule {value!r}: expected one of "
                                  + ", ".join(r.value for r in cls)) from None


class CounterRegion(Protocol):
    """What :class:`SharedCounters` uses of a region (a :class:`~smb_client.region.Region`)."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    def fetch_add(self, offset: int, value: int) -> int: ...

    def fetch_add_many(self, items: Iterable[tuple[int, int]]) -> list[int]: ...

    def compare_swap(self, offset: int, expected: int, desired: int) -> int: ...

    def read(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Any: ...


class SharedCounters:
    """One worker's view of the counters region (``store.region("counters")`` or any
    region of at least ``(8 + workers) * 8`` bytes). The region handle is the caller's."""

    def __init__(self, region: CounterRegion, rank: int, workers: int, rule: str | StopRule = StopRule.MASTER,
                 target: int = 0, *, lockstep: bool = False) -> None:
        if not 0 <= rank < workers:
            raise InvalidArgument(f"rank {rank} outside 0..{workers - 1}")
        if region.size < (COUNTER_WORDS + workers) * 8:
            raise InvalidArgument(f"counters region {region.name} holds {region.size} bytes; "
                                  f"{workers} workers need {(COUNTER_WORDS + workers) * 8}")
        if target < 0:
            raise InvalidArgument(f"target must not be negative, got {target}")
        self.region = region
        self.rank = rank
        self.workers = workers
        self.rule = StopRule.parse(rule)
        self.target = target
        self.lockstep = lockstep
        self.count = 0           # this worker's published iterations
        self.total_seen = 0      # the total as of this worker's last tick

    @staticmethod
    def _offset(word: int) -> int:
        return word * 8

    def rank_offset(self, rank: int) -> int:
        """Byte offset of worker ``rank``'s iteration count."""
        return (COUNTER_WORDS + rank) * 8

    def _fires(self) -> bool:
        if not self.target:
            return False
        if self.rule is StopRule.MASTER:
            return self.rank == 0 and self.count >= self.target
        if self.rule is StopRule.FASTEST:
            return self.count >= self.target
        return self.total_seen >= self.target * self.workers

    def publish(self, iterations: int = 1) -> None:
        """Publish ``iterations`` finished iterations and fire the rule if it is met
        (without reading the stop word). Lockstep workers publish before their step's
        barrier and call :meth:`should_stop` after it."""
        self._publish(iterations, read_stop=False)

    def tick(self, iterations: int = 1) -> bool:
        """Publish finished iterations; True when this worker should stop now.

        One request (one round trip, paid every step): this worker's count, the total
        under the ``average`` rule and the stop word go together (``fetch_add_many``; the
        stop word read after the adds); a second one only when this worker fires the rule.
        """
        return self._stops_at(self._publish(iterations, read_stop=True))

    def _publish(self, iterations: int, *, read_stop: bool) -> int:
        """Add ``iterations`` to this worker's count (and the total under ``average``),
        with the stop word read after them when ``read_stop``, in one request; fire the
        rule if it is met and the stop word is not known to be set. Returns the stop word
        (0 when not read and this worker did not set it)."""
        if iterations < 1:
            raise InvalidArgument(f"iterations must be >= 1, got {iterations}")
        ops = [(self.rank_offset(self.rank), iterations)]
        if self.rule is StopRule.AVERAGE:
            ops.append((self._offset(TOTAL_WORD), iterations))
        if read_stop:
            ops.append((self._offset(STOP_WORD), 0))
        olds = self.region.fetch_add_many(ops)
        self.count = olds[0] + iterations
        if self.rule is StopRule.AVERAGE:
            self.total_seen = olds[1] + iterations
        stop = olds[-1] if read_stop else 0
        if stop == 0 and self._fires():
            stop = self.region.compare_swap(self._offset(STOP_WORD), 0, self.count) or self.count
        return stop

    def stop_word(self) -> int:
        """The stop word now (0: running; else the count at which a rule fired)."""
        return self.region.fetch_add(self._offset(STOP_WORD), 0)

    def should_stop(self) -> bool:
        """Whether this worker should stop now (lockstep: once its count reached the stop word)."""
        return self._stops_at(self.stop_word())

    def _stops_at(self, stop: int) -> bool:
        """Whether the stop word ``stop`` stops this worker now."""
        if stop == 0:
            return False
        return self.count >= stop if self.lockstep else True

    def request_stop(self) -> None:
        """Ask everyone to stop, between this worker's steps: the stop word becomes the
        count after its next step. This worker has read the word for its last step
        already, so it stops after the next one; lockstep workers that read the word for
        the same last step may see it before or after this, so it must not stop them at
        that step (they would leave this worker alone in the next one): one past the
        count stops every one of them after the next step, whichever read sees it first."""
        self.region.compare_swap(self._offset(STOP_WORD), 0, self.count + 1)

    def finish(self) -> int:
        """Record that this worker finished; returns how many have, itself included."""
        return self.region.fetch_add(self._offset(FINISHED_WORD), 1) + 1

    def snapshot(self) -> dict[str, Any]:
        """Stop word, total, finished and per-worker counts, read in one request."""
        words = self.region.read(0, (COUNTER_WORDS + self.workers) * 8, dtype="int64")
        words = np.asarray(words)
        counts = [int(x) for x in words[COUNTER_WORDS:COUNTER_WORDS + self.workers]]
        return {"stop": int(words[STOP_WORD]), "total": sum(counts),
                "finished": int(words[FINISHED_WORD]), "counts": counts}
