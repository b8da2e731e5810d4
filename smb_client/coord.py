"""Coordination on the memory servers: waits on int64 words, leased locks, barriers.

All of it is served by the memory server that holds the word, so a training step needs
no controller call:

* :func:`wait` (also :meth:`Region.wait <smb_client.region.Region.wait>`) blocks, without
  polling, until an int64 word reaches a value (``>=``), equals one, or changes. The
  server wakes the wait when a write, accumulate, axpy, scale, fetch_add, compare_swap,
  lock or unlock it serves touches the word.
* :class:`Lock` is a lock word with a lease kept by the server: a holder that dies
  (``kill -9``) frees it once its lease ran out; a live holder renews it in the
  background. A context manager.
* :class:`Barrier` counts arrivals with ``fetch_add`` on one word that only grows, and
  waits until the count reaches ``parties × (generation + 1)``: no reset round.
* A wait that lasts longer than :data:`REPORT_EVERY` seconds says what it waits for,
  every :data:`REPORT_EVERY` seconds, as a warning ("barrier job/step: 3 of 4 arrived");
  one whose parties never all come raises :class:`PartiesMissing`, which names how many
  came and, with an :class:`Attendance`, the ranks that did not.

Transport rule: these requests always go over the server's tcp data plane, whatever
transport the region's data uses (:meth:`Route.coordinate
<smb_client.route.Route.coordinate>` sends them through the server's tcp session, whose
``wait``, ``lock`` and ``unlock`` use connections of their own: the tcp protocol answers
in order, so a waiting request holds its connection). They run under the region's
route, with its ticket renewal, failover and incarnation check. The waited word
must be changed through the server to wake a wait at once: shm copies and one-sided
RDMA writes and atomics bypass it, and are seen by the server's re-read every
:data:`smb_server.memserver.waiters.RECHECK` seconds (0.05). So barriers and locks send
their ``fetch_add`` over tcp too, and a coordination word should be changed with
``fetch_add``/``compare_swap`` (which shm sends to the server) rather than ``write``.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from smb_protocol.errors import BarrierTimeout, InvalidArgument, LockNotHeld, Timeout
from smb_protocol.waits import ranks_text
from smb_protocol.wire import WaitCond

from .metrics import timed_method
from .region import Region
from .retrying import WAIT_SLICE, in_slices, until

log = logging.getLogger(__name__)

__all__ = ["Attendance", "Barrier", "Lock", "PartiesMissing", "REPORT_EVERY", "Roll", "WaitCond", "wait",
           "WAIT_SLICE", "controller_barrier", "ranks_text", "report_waiting"]

DEFAULT_LEASE = 10.0    # seconds
REPORT_EVERY = 5.0      # seconds a wait for other parties runs before it says so, and between reports


class PartiesMissing(BarrierTimeout):
    """Not every party came to a wait in time. ``what`` names the wait, ``arrived`` and
    ``parties`` count them (None where unknown), ``missing`` lists the ranks that did not
    come (None where nobody keeps an :class:`Attendance`)."""

    def __init__(self, message: str, *, what: str = "", arrived: int | None = None,
                 parties: int | None = None, missing: Sequence[int] | None = None) -> None:
        super().__init__(message, arrived=arrived, parties=parties, missing=missing)
        self.what = what


class Roll(Protocol):
    """Who has come to the waits of a group of ranks (:class:`Attendance`, or a
    process group's own): :meth:`arrive` at each wait, :meth:`missing` when one stalls."""

    def arrive(self) -> None:
        """Count one more arrival of this rank (at every wait, in the same order)."""

    def missing(self) -> list[int] | None:
        """The ranks that have not come as far as this one, or None when unknown."""


def report_waiting(what: str, waited: float, arrived: int | None, parties: int | None,
                   missing: Sequence[int] | None) -> None:
    """Log the warning of a wait that lasts (``waited`` seconds so far)."""
    count = f"{arrived} of {parties} arrived" if arrived is not None else f"{parties} parties expected"
    log.warning("%s: %s, waiting for %.0f s%s", what, count, waited, ranks_text(missing))


class BarrierSource(Protocol):
    """What :func:`controller_barrier` needs of a client (a :class:`~smb_client.client.Client`)."""

    def barrier(self, name: str, parties: int, timeout: float | None = None, *,
                rank: int | None = None) -> int:
        """The controller's barrier ``name`` of ``parties``, this caller being ``rank``."""


def controller_barrier(client: BarrierSource, name: str, parties: int, timeout: float | None = None, *,
                       rank: int | None = None, report_every: float | None = None) -> int:
    """The controller's barrier ``name`` (:meth:`Client.barrier
    <smb_client.client.Client.barrier>`), waited for in slices of ``report_every``
    seconds, each late one logged with how many had arrived (a caller whose slice ran
    out leaves the barrier, so arriving again is safe); :class:`PartiesMissing` after
    ``timeout`` seconds (None: for ever). When every party gives its ``rank``, both name
    the ranks that did not come. Returns the generation."""
    deadline = until(timeout)
    started = time.monotonic()
    what = f"barrier {name}"
    every = REPORT_EVERY if report_every is None else report_every
    while True:
        left = deadline - time.monotonic()
        try:
            return client.barrier(name, parties, timeout=max(0.001, min(left, every)), rank=rank)
        except BarrierTimeout as exc:
            arrived, missing = exc.arrived, exc.missing
            waited = time.monotonic() - started
            if time.monotonic() >= deadline:
                counted = f"{arrived} of {parties} parties arrived" if arrived is not None else \
                    f"not all {parties} parties arrived"
                raise PartiesMissing(f"{what}: {counted} within {waited:.0f} s{ranks_text(missing)}",
                                     what=what, arrived=arrived, parties=parties, missing=missing) from None
            report_waiting(what, waited, arrived, parties, missing)


class Attendance:
    """Who came to a group's waits: rank ``r`` counts its arrivals on the int64 word at
    byte ``offset + 8 r`` of ``region`` (``parties`` words, zeroed before the group's
    first wait by one rank while nobody waits), so that a stalled wait can name the
    ranks that have not come as far. :meth:`arrive` is asynchronous (a ``fetch_add``
    through the server); the region handle is the caller's."""

    def __init__(self, region: Region, offset: int, parties: int, rank: int) -> None:
        if not 0 <= rank < parties:
            raise InvalidArgument(f"rank {rank} outside 0..{parties - 1}")
        if offset < 0 or offset % 8 or offset + 8 * parties > region.size:
            raise InvalidArgument(f"{parties} attendance words at byte {offset} do not fit region "
                                  f"{region.name} ({region.size} bytes)")
        self.region = region
        self.offset = offset
        self.parties = parties
        self.rank = rank
        self.count = 0                          # this rank's arrivals
        self._last: Future[int] | None = None

    def reset(self) -> None:
        """Zero every rank's word (one rank, before the group's first wait)."""
        self.region.write(self.offset, bytes(8 * self.parties))

    def arrive(self) -> None:
        """Count one more arrival of this rank (sent without waiting for the answer)."""
        self.count += 1
        self._last = self.region.fetch_add_async(self.offset + 8 * self.rank, 1)

    def missing(self) -> list[int] | None:
        """The ranks whose count is below this rank's; None when the words cannot be read."""
        try:
            if self._last is not None:
                self._last.result()
            raw = bytes(self.region.read(self.offset, 8 * self.parties))
        except Exception as exc:   # a report, not the wait: say why and go on
            log.info("attendance in %s unreadable: %r", self.region.name, exc)
            return None
        counts = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
        return [r for r, c in enumerate(counts) if c < self.count]


def wait(region: Region, offset: int, *, value: int | None = None, equals: int | None = None,
         changed_from: int | None = None, timeout: float | None = None) -> int:
    """Block until the int64 at byte ``offset`` of ``region`` is ``>= value``, ``==
    equals`` or ``!= changed_from`` (exactly one of them); returns the word then
    (:meth:`Region.wait <smb_client.region.Region.wait>`).

    ``timeout`` (seconds; None: for ever) raises :class:`~smb_protocol.errors.Timeout`.
    """
    return region.wait(offset, value=value, equals=equals, changed_from=changed_from, timeout=timeout)


class Barrier:
    """A barrier of ``parties`` on the int64 word at byte ``offset`` of ``region``
    (zero, or left by earlier rounds of the same parties; never written otherwise).

    Each :meth:`wait` adds 1 to the word (``fetch_add`` on the server) and waits until it
    reaches ``parties × (g + 1)``, where ``g = old // parties`` is the generation the
    arrival belongs to. The word only grows, so a party that runs ahead into the next
    round cannot confuse the others. A party that times out has still arrived: the
    barrier is then out of step for every party, as a broken barrier is.

    ``name`` (default: the word's place) names it in reports; ``roll`` (an
    :class:`Attendance`) lets a stalled wait name the ranks that have not come. A wait
    longer than ``report_every`` seconds logs what it waits for, again every
    ``report_every`` seconds; one that times out raises :class:`PartiesMissing`.
    """

    def __init__(self, region: Region, offset: int, parties: int, *, name: str | None = None,
                 roll: Roll | None = None, report_every: float | None = None) -> None:
        if not isinstance(parties, int) or parties < 1:
            raise InvalidArgument(f"parties must be a positive number, not {parties!r}")
        region.route.check_writable()
        self._slot, self._eoff = region.route.word(offset)
        self.region = region
        self.offset = offset
        self.parties = parties
        self.name = name or f"barrier at byte {offset} of {region.name}"
        self.roll = roll
        self.report_every = REPORT_EVERY if report_every is None else report_every

    def wait(self, timeout: float | None = None) -> int:
        """Arrive and wait for the other parties; returns the generation (0, 1, ...).
        :class:`PartiesMissing` (a :class:`~smb_protocol.errors.BarrierTimeout`) after
        ``timeout`` seconds, naming how many came and who did not."""
        deadline = until(timeout)
        started = time.monotonic()
        route = self.region.route
        if self.roll is not None:
            self.roll.arrive()
        seq = route.next_seq()      # a retry is answered, not added again
        # through the server (tcp), whatever the region's transport: it wakes the waits
        old = route.coordinate(self._slot, lambda s, place: s.fetch_add(
            route.ticket, place.extent_id, self._eoff, 1, seq))
        generation = old // self.parties
        target = (generation + 1) * self.parties
        what = f"{self.name}, generation {generation}"
        while True:
            left = deadline - time.monotonic()
            try:
                wait(self.region, self.offset, value=target,
                     timeout=max(0.0, min(left, self.report_every)))
                return generation
            except Timeout as exc:
                word = self._arrived(generation)
                missing = self.roll.missing() if self.roll is not None else None
                waited = time.monotonic() - started
                if time.monotonic() >= deadline:
                    raise PartiesMissing(
                        f"{what}: {word} of {self.parties} parties arrived within {waited:.0f} s"
                        f"{ranks_text(missing)} ({exc})", what=what, arrived=word, parties=self.parties,
                        missing=missing) from None
                report_waiting(what, waited, word, self.parties, missing)

    async def await_parties(self, timeout: float | None = None) -> int:
        """:meth:`wait` as a coroutine (``await barrier.await_parties()``): it waits in a
        thread of the event loop's default executor (:func:`asyncio.to_thread`) while the
        loop goes on. A cancelled await returns at once; this party has arrived all the
        same (as after a timeout), and the others are released once all have come."""
        return await asyncio.to_thread(self.wait, timeout)

    def _arrived(self, generation: int) -> int:
        """How many parties arrived in ``generation`` so far (read through the server)."""
        route = self.region.route
        seq = route.next_seq()
        now = route.coordinate(self._slot, lambda s, place: s.fetch_add(
            route.ticket, place.extent_id, self._eoff, 0, seq))
        return int(max(0, min(self.parties, now - generation * self.parties)))


class Lock:
    """A lock on the int64 word at byte ``offset`` of ``region`` (0: free; else the
    holder's id), with a lease of ``lease`` seconds kept by the server.

    ``with Lock(region, 0):`` takes it (waiting for ever, or ``timeout`` seconds, then
    :class:`~smb_protocol.errors.Timeout`) and frees it. While held, a background thread
    renews the lease every third of it (``keepalive=False``: call :meth:`renew`); if a
    renewal finds the lock taken by another (this process stalled past its lease),
    :meth:`release` raises :class:`~smb_protocol.errors.LockNotHeld`. A holder that dies
    frees the lock once its lease ran out. Use the word only through locks.
    """

    def __init__(self, region: Region, offset: int, *, lease: float = DEFAULT_LEASE,
                 timeout: float | None = None, keepalive: bool = True) -> None:
        if not (isinstance(lease, (int, float)) and 0.01 <= lease <= 86400):
            raise InvalidArgument(f"lease must be 0.01..86400 seconds, not {lease!r}")
        region.route.check_writable()
        self._slot, self._eoff = region.route.word(offset)
        self.region = region
        self.offset = offset
        self.lease = float(lease)
        self.timeout = timeout
        self.keepalive = keepalive
        self.holder = secrets.randbits(63) | 1      # this lock object's id in the word
        self._held = False
        self._lost: LockNotHeld | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """True between a successful :meth:`acquire` and :meth:`release`, while no
        renewal found the lock lost."""
        return self._held and self._lost is None

    def _lock(self, timeout: float) -> int:
        route = self.region.route
        return route.coordinate(self._slot, lambda s, place: s.lock(
            route.ticket, place.extent_id, self._eoff, self.holder, self.lease, timeout))

    @timed_method("lock")
    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (None: for ever, or this
        lock's ``timeout``); :class:`~smb_protocol.errors.Timeout` when it stays held."""
        if self._held:
            raise InvalidArgument("this lock is already held by this Lock object")
        deadline = until(self.timeout if timeout is None else timeout)
        old = in_slices(deadline, self._lock)
        if old not in (0, self.holder):
            log.info("lock at byte %d of %s: taken over from holder %#x whose lease ran out",
                     self.offset, self.region.name, old)
        self._held, self._lost = True, None
        if self.keepalive:
            self._stop.clear()
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name=f"smb-lock-{self.region.name}@{self.offset}")
            self._renewer.start()

    def renew(self) -> None:
        """Extend the lease by ``lease`` seconds from now; :class:`LockNotHeld` when
        another holder took the lock after this one's lease ran out."""
        if not self._held:
            raise LockNotHeld("renew() of a lock this Lock object does not hold")
        try:
            self._lock(0.0)
        except Timeout as exc:
            self._lost = LockNotHeld(f"lock at byte {self.offset} of {self.region.name}: the lease ran out "
                                     f"and another holder took it ({exc})")
            raise self._lost from None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease / 3):
            try:
                self.renew()
            except LockNotHeld as exc:
                log.warning("%s", exc)
                return
            except Exception as exc:   # a passing failure: the next renewal may succeed
                log.warning("lock at byte %d of %s: renewal failed: %s", self.offset, self.region.name, exc)

    def release(self) -> None:
        """Free the lock. :class:`LockNotHeld` when it was lost meanwhile (its lease ran
        out and another holder took it): what it protected may have been changed."""
        if not self._held:
            raise LockNotHeld("release() of a lock this Lock object does not hold")
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        self._held = False
        if self._lost is not None:
            raise self._lost
        route = self.region.route
        route.coordinate(self._slot, lambda s, place: s.unlock(route.ticket, place.extent_id, self._eoff,
                                                               self.holder))

    def __enter__(self) -> Lock:
        """:meth:`acquire` the lock."""
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`release` the lock."""
        self.release()
