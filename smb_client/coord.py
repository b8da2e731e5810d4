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

import logging
import math
import secrets
import threading
import time

from smb_protocol.errors import BarrierTimeout, InvalidArgument, LockNotHeld, Timeout
from smb_protocol.wire import WaitCond

from .region import Region
from .route import WAIT_SLICE, in_slices, until

log = logging.getLogger(__name__)

__all__ = ["Barrier", "Lock", "WaitCond", "wait", "WAIT_SLICE"]

DEFAULT_LEASE = 10.0    # seconds


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
    """

    def __init__(self, region: Region, offset: int, parties: int) -> None:
        if not isinstance(parties, int) or parties < 1:
            raise InvalidArgument(f"parties must be a positive number, not {parties!r}")
        region.route.check_writable()
        self._slot, self._eoff = region.route.word(offset)
        self.region = region
        self.offset = offset
        self.parties = parties

    def wait(self, timeout: float | None = None) -> int:
        """Arrive and wait for the other parties; returns the generation (0, 1, ...).
        :class:`~smb_protocol.errors.BarrierTimeout` after ``timeout`` seconds."""
        deadline = until(timeout)
        route = self.region.route
        seq = route.next_seq()      # a retry is answered, not added again
        # through the server (tcp), whatever the region's transport: it wakes the waits
        old = route.coordinate(self._slot, lambda s, place: s.fetch_add(
            route.ticket, place.extent_id, self._eoff, 1, seq))
        generation = old // self.parties
        try:
            wait(self.region, self.offset, value=(generation + 1) * self.parties,
                 timeout=max(0.0, deadline - time.monotonic()) if deadline != math.inf else None)
        except Timeout as exc:
            raise BarrierTimeout(f"barrier at byte {self.offset} of {self.region.name}: not all "
                                 f"{self.parties} parties arrived in generation {generation}: {exc}") from None
        return generation


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
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
