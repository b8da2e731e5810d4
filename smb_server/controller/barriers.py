"""Named, reusable, in-memory barriers for the controller's ``Barrier`` call.

Pure (no gRPC): the servicer passes the caller's ``is_active`` so that a caller that
went away is forgotten. Barriers do not survive a controller restart; callers retry on
``Unavailable``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from smb_protocol import errors
from smb_protocol.names import check_barrier_name

BARRIER_POLL = 0.5  # seconds between checks that a barrier caller is still there
MAX_WAITERS = 64    # callers that may wait in barriers at once, all barriers together
MAX_WAITERS_PER_CALLER = 16  # of those, from one caller (one client connection)


@dataclass
class _Waiter:
    generation: int = -1
    arrival: int = -1
    done: bool = False


@dataclass
class _Barrier:
    parties: int = 0
    generation: int = 0  # times this barrier has opened
    waiters: list[_Waiter] | None = None


class Barriers:
    """Named, reusable, in-memory barriers (pure; no gRPC).

    A barrier opens when ``parties`` callers of the current generation have arrived;
    each gets the generation (how many times the barrier opened before) and its
    0-based order of arrival. A caller that times out, goes away, or is woken by
    :meth:`close` is removed and does not count.

    At most ``max_waiters`` callers wait at once (each holds a server thread), and at
    most ``max_per_caller`` of them with the same ``caller`` key; the next one is
    refused with ControllerBusy, whatever barrier it names.
    """

    def __init__(self, max_waiters: int = MAX_WAITERS,
                 max_per_caller: int = MAX_WAITERS_PER_CALLER) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self._closed = False
        self.max_waiters = max_waiters
        self.max_per_caller = max_per_caller
        self._waiting = 0
        self._by_caller: dict[str, int] = {}

    def wait(self, name: str, parties: int, timeout: float | None = None,
             is_active: Callable[[], bool] = lambda: True, caller: str = "") -> tuple[int, int]:
        """Block until the barrier opens; returns ``(generation, arrival)``.

        ``timeout`` in seconds (None or <= 0: forever). Raises InvalidArgument (no name,
        ``parties`` 0, or a ``parties`` other than the waiting callers'), BarrierTimeout,
        or ControllerUnavailable when the controller closes, ``is_active`` turns false,
        or ``max_waiters`` callers (``max_per_caller`` with this ``caller`` key) already wait.
        """
        check_barrier_name(name)
        if parties <= 0:
            raise errors.InvalidArgument("a barrier needs at least one party")
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        with self._cond:
            if self._closed:
                raise errors.ControllerUnavailable("the controller is shutting down")
            barrier = self._barriers.setdefault(name, _Barrier(waiters=[]))
            assert barrier.waiters is not None
            if barrier.waiters and barrier.parties != parties:
                raise errors.InvalidArgument(
                    f"barrier {name!r} is waiting for {barrier.parties} parties "
                    f"({len(barrier.waiters)} arrived); this caller says {parties}")
            opens = len(barrier.waiters) + 1 >= parties
            mine = self._by_caller.get(caller, 0)
            if not opens and self._waiting >= self.max_waiters:
                raise errors.ControllerBusy(
                    f"controller busy: {self._waiting} callers wait in barriers (the most "
                    f"allowed); barrier {name!r} refused, retry later")
            if not opens and mine >= self.max_per_caller:
                raise errors.ControllerBusy(
                    f"controller busy: this caller already waits in {mine} barriers (the most "
                    f"one caller may); barrier {name!r} refused, retry later")
            barrier.parties = parties
            me = _Waiter()
            barrier.waiters.append(me)
            if opens:
                self._open(barrier)
                return me.generation, me.arrival
            self._waiting += 1
            self._by_caller[caller] = mine + 1
            try:
                return self._wait(name, parties, timeout, deadline, barrier, me, is_active)
            finally:
                self._waiting -= 1
                left = self._by_caller.pop(caller) - 1
                if left:
                    self._by_caller[caller] = left

    def _wait(self, name: str, parties: int, timeout: float | None, deadline: float | None,
              barrier: _Barrier, me: _Waiter, is_active: Callable[[], bool]) -> tuple[int, int]:
        """Wait (holding the condition) until ``me`` is released; see :meth:`wait`."""
        assert barrier.waiters is not None
        while not me.done:
            problem: errors.SMBError | None = None
            remaining = None if deadline is None else deadline - time.monotonic()
            if self._closed:
                problem = errors.ControllerUnavailable("the controller is shutting down")
            elif remaining is not None and remaining <= 0:
                problem = errors.BarrierTimeout(
                    f"barrier {name!r}: {len(barrier.waiters)} of {parties} parties arrived "
                    f"within {timeout:g} s")
            elif not is_active():
                problem = errors.ControllerUnavailable("the caller went away")
            if problem is not None:
                barrier.waiters.remove(me)
                raise problem
            self._cond.wait(BARRIER_POLL if remaining is None else min(remaining, BARRIER_POLL))
        return me.generation, me.arrival

    def _open(self, barrier: _Barrier) -> None:
        assert barrier.waiters is not None
        for arrival, waiter in enumerate(barrier.waiters):
            waiter.generation, waiter.arrival, waiter.done = barrier.generation, arrival, True
        barrier.generation += 1
        barrier.waiters = []
        self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with ControllerUnavailable; later calls fail the same way."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
