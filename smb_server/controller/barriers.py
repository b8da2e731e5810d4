"""Named, reusable, in-memory barriers for the controller's ``Barrier`` call.

Pure (no gRPC): the servicer passes the caller's ``is_active`` so that a caller that
went away is forgotten.

With a replicated store (etcd) a barrier's generation (how many times it opened) lives
in the store (:class:`GenerationStore`), with the arrival ids of its last opening: both
are written, fenced by the leader epoch, before a barrier opens, and read by a new leader.
Arrivals waiting for an opening stay in the leader's memory: when a leader dies or stops
leading, its waiters' calls fail with ControllerUnavailable (:meth:`Barriers.reset`),
and the client retries them at the new leader, where they arrive again in the same
generation. A caller names each arrival (an arrival id, the same in its retries), so
that a retry whose reply was lost after the opening (a failover) is answered from the
opening it took part in, and a retry while its first call still waits replaces it:
neither is counted twice. With SQLite the generations and arrival ids are in memory and
a restart starts them again at 0.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from smb_protocol import errors
from smb_protocol.names import check_barrier_name
from smb_protocol.waits import ranks_text

BARRIER_POLL = 0.5  # seconds between checks that a barrier caller is still there
MAX_WAITERS = 64    # callers that may wait in barriers at once, all barriers together
MAX_WAITERS_PER_CALLER = 16  # of those, from one caller (one client connection)
_ARRIVAL_ID = re.compile(r"[0-9a-f]{32}")


class GenerationStore(Protocol):
    """Where barriers' generations outlive a leader (:class:`.stores.etcd.state.EtcdState`)."""

    def barrier_generation(self, name: str) -> tuple[int, tuple[str, ...]]:
        """How many times barrier ``name`` has opened (0: never), and the arrival ids of
        its last opening, in order of arrival ("" for a caller that gave none)."""
        ...

    def open_barrier(self, name: str, generation: int, arrivals: Sequence[str]) -> None:
        """Record that barrier ``name`` opens for the ``generation``-th time (it opened
        ``generation - 1`` times before) with the ``arrivals`` (ids, in order); raises
        ControllerUnavailable when this controller no longer leads."""
        ...


@dataclass(eq=False)   # waiters are told apart by identity: two may look alike
class _Waiter:
    arrival_id: str = ""
    rank: int | None = None                # the caller's rank, where it gave one
    generation: int = -1
    arrival: int = -1
    done: bool = False
    error: errors.SMBError | None = None   # set with ``done`` when the call fails instead


@dataclass
class _Barrier:
    parties: int = 0
    generation: int = 0  # times this barrier has opened
    waiters: list[_Waiter] | None = None
    last: tuple[str, ...] = ()  # arrival ids of the last opening, in order of arrival


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
                 max_per_caller: int = MAX_WAITERS_PER_CALLER, store: GenerationStore | None = None) -> None:
        self._cond = threading.Condition()
        self.store = store
        self._barriers: dict[str, _Barrier] = {}
        self._closed = False
        self.max_waiters = max_waiters
        self.max_per_caller = max_per_caller
        self._waiting = 0
        self._by_caller: dict[str, int] = {}

    def wait(self, name: str, parties: int, timeout: float | None = None,
             is_active: Callable[[], bool] = lambda: True, caller: str = "",
             arrival_id: str = "", rank: int | None = None) -> tuple[int, int]:
        """Block until the barrier opens; returns ``(generation, arrival)``.

        ``timeout`` in seconds (None or <= 0: forever). ``arrival_id`` (32 lowercase hex
        digits, or "": none): the caller's name for this arrival, the same in its
        retries; a retry of an arrival the last opening counted returns what that
        opening gave it, at once, and a retry of one still waiting takes its place.
        ``rank`` (0 .. parties-1, or None): the caller's rank, so that a timeout names
        the ranks missing when every caller waiting gave one ("; missing: rank 2, 3").
        Raises InvalidArgument (no name, ``parties`` 0, a ``parties`` other than the
        waiting callers', a malformed arrival id, a rank out of range), BarrierTimeout, or
        ControllerUnavailable when the controller closes, ``is_active`` turns false, or
        ``max_waiters`` callers (``max_per_caller`` with this ``caller`` key) already wait.
        """
        check_barrier_name(name)
        if parties <= 0:
            raise errors.InvalidArgument("a barrier needs at least one party")
        if arrival_id and not _ARRIVAL_ID.fullmatch(arrival_id):
            raise errors.InvalidArgument(f"an arrival id is 32 lowercase hex digits, not {arrival_id!r}")
        if rank is not None and not 0 <= rank < parties:
            raise errors.InvalidArgument(f"barrier {name!r}: rank {rank} is not among {parties} parties "
                                         f"(0 .. {parties - 1})")
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        with self._cond:
            if self._closed:
                raise errors.ControllerUnavailable("the controller is shutting down")
            barrier = self._barriers.get(name)
            if barrier is None:
                generation, last = self.store.barrier_generation(name) if self.store is not None else (0, ())
                barrier = self._barriers[name] = _Barrier(generation=generation, waiters=[], last=last)
            assert barrier.waiters is not None
            if arrival_id and arrival_id in barrier.last:   # its reply was lost: what it got
                return barrier.generation - 1, barrier.last.index(arrival_id)
            for earlier in [w for w in barrier.waiters if arrival_id and w.arrival_id == arrival_id]:
                barrier.waiters.remove(earlier)             # its caller gave up on it: this retry counts
                earlier.error, earlier.done = errors.ControllerUnavailable("retried by its caller"), True
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
            me = _Waiter(arrival_id, rank)
            barrier.waiters.append(me)
            if opens:
                self._open(name, barrier)
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
                missing = _missing(barrier.waiters, parties)
                problem = errors.BarrierTimeout(
                    f"barrier {name!r}: {len(barrier.waiters)} of {parties} parties arrived "
                    f"within {timeout:g} s{ranks_text(missing)}",
                    arrived=len(barrier.waiters), parties=parties, missing=missing)
            elif not is_active():
                problem = errors.ControllerUnavailable("the caller went away")
            if problem is not None:
                barrier.waiters.remove(me)
                raise problem
            self._cond.wait(BARRIER_POLL if remaining is None else min(remaining, BARRIER_POLL))
        if me.error is not None:
            raise me.error
        return me.generation, me.arrival

    def _open(self, name: str, barrier: _Barrier) -> None:
        """Release the barrier's waiters, once the store (if any) has its new generation;
        if it cannot be written, every waiter fails (and retries at the leader)."""
        assert barrier.waiters is not None
        arrivals = tuple(w.arrival_id for w in barrier.waiters)
        if self.store is not None:
            try:
                self.store.open_barrier(name, barrier.generation + 1, arrivals)
            except errors.SMBError as exc:
                self._fail(barrier, exc)
                self._barriers.pop(name, None)
                raise
        for arrival, waiter in enumerate(barrier.waiters):
            waiter.generation, waiter.arrival, waiter.done = barrier.generation, arrival, True
        barrier.generation += 1
        barrier.waiters = []
        barrier.last = arrivals
        self._cond.notify_all()

    def _fail(self, barrier: _Barrier, error: errors.SMBError) -> None:
        for waiter in barrier.waiters or ():
            waiter.error, waiter.done = error, True
        barrier.waiters = []
        self._cond.notify_all()

    def reset(self, reason: str) -> None:
        """Fail every waiter with ControllerUnavailable(``reason``) and forget every
        barrier (a leader that stops leading: its callers retry at the new one, which
        reads the generations from the store)."""
        with self._cond:
            for barrier in self._barriers.values():
                self._fail(barrier, errors.ControllerUnavailable(reason))
            self._barriers.clear()

    def close(self) -> None:
        """Wake every waiter with ControllerUnavailable; later calls fail the same way."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _missing(waiters: Sequence[_Waiter], parties: int) -> list[int] | None:
    """The ranks none of ``waiters`` holds, when every one of them gave its rank (None
    otherwise: who is missing is then unknown)."""
    ranks = {w.rank for w in waiters}
    if None in ranks:
        return None
    return [r for r in range(parties) if r not in ranks]
