"""Backoff and retry: the one policy every reconnecting loop in the project uses.

:class:`Backoff` yields the delays (seconds) of capped exponential backoff with optional
jitter; :class:`Retry` runs a callable again on the errors it names until a deadline.
Both are small and deterministic given a ``random.Random`` and a clock, so they are
tested on their own. A loop that must also stop early (a daemon shutting down) passes
``sleep=stop_event.wait``-style functions: a sleep that returns True ends the retrying.

Why not a retry library (tenacity): the loops here are few, need a stop event as well as
a deadline, and keep their own state between attempts (a heartbeat loop re-registers);
the decorator model fits none of them better than these forty lines.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# one generator for every Backoff that is not given its own: seeding a new Random (from
# os.urandom) per Backoff cost ~10 us, paid on every region operation
_SHARED_RNG = random.Random()


@dataclass
class Backoff:
    """Capped exponential backoff: ``first``, ``first*factor``, ... up to ``cap`` seconds.

    ``jitter`` is the fraction of each delay drawn at random (0: exact delays; 0.5: each
    delay uniformly in [d/2, d]), so that many clients do not retry in lockstep.
    ``per_round``: attempts in one round, for a list of that many servers tried in turn
    (the caller moves to the next after a failure): the next server is tried at once,
    and the delay comes only after a whole round, so that a standby that just took over
    is reached without waiting behind the others' delays. :meth:`reset` starts again
    from ``first`` and a new round (after a success).
    """

    first: float = 0.05
    cap: float = 1.0
    factor: float = 2.0
    jitter: float = 0.0
    rng: random.Random = field(default=_SHARED_RNG, repr=False)
    per_round: int = 1
    _next: float = field(init=False, repr=False, default=0.0)
    _tried: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        if not (self.first > 0 and self.cap >= self.first and self.factor >= 1.0
                and 0.0 <= self.jitter <= 1.0 and self.per_round >= 1):
            raise ValueError(f"bad backoff parameters: first={self.first} cap={self.cap} "
                             f"factor={self.factor} jitter={self.jitter} per_round={self.per_round}")
        self._next = self.first

    def reset(self) -> None:
        self._next = self.first
        self._tried = 0

    def next_delay(self) -> float:
        """The delay (seconds) before the next attempt; grows the one after (0 within a
        round: see ``per_round``)."""
        self._tried += 1
        if self._tried % self.per_round:
            return 0.0
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        if self.jitter:
            delay -= delay * self.jitter * self.rng.random()
        return delay

    def delays(self) -> Iterator[float]:
        while True:
            yield self.next_delay()


@dataclass
class Retry:
    """Call a function again while it raises one of ``on``, for at most ``timeout``
    seconds in all (None: forever), waiting ``backoff`` delays in between.

    The last error is re-raised when the next wait would pass the deadline, or when
    ``sleep`` returns True (a stop event was set). ``on`` must name only errors after
    which running the function again is safe (it did not take effect).
    """

    on: tuple[type[BaseException], ...]
    timeout: float | None = 5.0
    backoff: Backoff = field(default_factory=Backoff)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], object] = time.sleep

    def __call__(self, fn: Callable[[], T], what: str = "") -> T:
        deadline = None if self.timeout is None else self.clock() + self.timeout
        self.backoff.reset()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except self.on as exc:
                delay = self.backoff.next_delay()
                if deadline is not None and self.clock() + delay > deadline:
                    raise
                log.debug("%s failed (attempt %d: %s); again in %.3f s", what or "call", attempt, exc, delay)
                if self.sleep(delay) is True:
                    raise
