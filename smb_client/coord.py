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
transport the region's data uses, each wait on a connection of its own (the tcp
protocol answers in order, so a waiting request holds its connection). The waited word
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
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from smb_protocol import wire
from smb_protocol.errors import BarrierTimeout, InvalidArgument, LockNotHeld, Timeout
from smb_protocol.placement import ExtentPlace
from smb_protocol.wire import WaitCond

from .transports.tcp import TcpSession

if TYPE_CHECKING:
    from .region import Region

log = logging.getLogger(__name__)

__all__ = ["Barrier", "Lock", "WaitCond", "wait"]

WAIT_SLICE = 30.0       # seconds one request waits at most; longer waits send several
DEFAULT_LEASE = 10.0    # seconds
_WORD = struct.Struct("<q")


def _tcp(region: Region, offset: int) -> tuple[ExtentPlace, int, TcpSession]:
    place, eoff = region._word(offset)
    session = region._dataplane.coordination(place)
    if not isinstance(session, TcpSession):
        raise InvalidArgument(f"coordination needs a tcp session to server {place.server_id}, "
                              f"got {type(session).__name__}")
    return place, eoff, session


def _request(region: Region, offset: int, op: wire.Op, timeout: float, **args: Any) -> int:
    """One coordination request on a wait connection of the word's server; the word."""
    def run() -> int:
        # looked up on every attempt: a replicated region's retry goes to the new primary
        place, eoff, session = _tcp(region, offset)
        with session.waits.borrow() as conn:
            conn.present(region._ticket)
            conn.sock.settimeout(timeout + session.io_timeout)
            try:
                body = conn.request(op, place.extent_id, eoff, 8, alpha=timeout, **args)
            finally:
                if not conn.closed:
                    conn.sock.settimeout(session.io_timeout)
        return int(_WORD.unpack(body)[0])
    return int(region._retrying(run))


def _deadline(timeout: float | None) -> float:
    if timeout is None:
        return math.inf
    if not (isinstance(timeout, (int, float)) and timeout >= 0 and not math.isnan(timeout)):
        raise InvalidArgument(f"timeout must be >= 0 seconds or None, not {timeout!r}")
    return time.monotonic() + timeout


def _sliced(deadline: float, fn: Any) -> int:
    """Call ``fn(seconds)`` with slices of at most :data:`WAIT_SLICE` until it returns or
    ``deadline`` (monotonic) passes; the last :class:`Timeout` propagates."""
    while True:
        left = max(0.0, min(deadline - time.monotonic(), WAIT_SLICE))
        try:
            return int(fn(left))
        except Timeout:
            if time.monotonic() >= deadline:
                raise


def wait(region: Region, offset: int, *, value: int | None = None, equals: int | None = None,
         changed_from: int | None = None, timeout: float | None = None) -> int:
    """Block until the int64 at byte ``offset`` of ``region`` is ``>= value``, ``==
    equals`` or ``!= changed_from`` (exactly one of them); returns the word then.

    ``timeout`` (seconds; None: for ever) raises :class:`~smb_protocol.errors.Timeout`.
    """
    given = [(c, v) for c, v in ((WaitCond.AT_LEAST, value), (WaitCond.EQUAL, equals),
                                 (WaitCond.CHANGED, changed_from)) if v is not None]
    if len(given) != 1:
        raise InvalidArgument("wait for exactly one of value= (>=), equals= or changed_from=")
    cond, target = given[0]
    deadline = _deadline(timeout)
    return _sliced(deadline, lambda left: _request(region, offset, wire.Op.WAIT, left, dtype=cond,
                                                   arg0=int(target)))


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
        region._check_writable()
        region._word(offset)
        self.region = region
        self.offset = offset
        self.parties = parties

    def wait(self, timeout: float | None = None) -> int:
        """Arrive and wait for the other parties; returns the generation (0, 1, ...).
        :class:`~smb_protocol.errors.BarrierTimeout` after ``timeout`` seconds."""
        deadline = _deadline(timeout)
        seq = self.region._dataplane.next_seq()      # a retry is answered, not added again

        def arrive() -> int:
            place, eoff, session = _tcp(self.region, self.offset)
            return int(session.fetch_add(self.region._ticket, place.extent_id, eoff, 1, seq))
        old = int(self.region._retrying(arrive))
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
        region._check_writable()
        region._word(offset)
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
        return _request(self.region, self.offset, wire.Op.LOCK, timeout, arg0=self.holder,
                        arg1=max(1, round(self.lease * 1000)))

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (None: for ever, or this
        lock's ``timeout``); :class:`~smb_protocol.errors.Timeout` when it stays held."""
        if self._held:
            raise InvalidArgument("this lock is already held by this Lock object")
        deadline = _deadline(self.timeout if timeout is None else timeout)
        old = _sliced(deadline, self._lock)
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
        _request(self.region, self.offset, wire.Op.UNLOCK, 0.0, arg0=self.holder)

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
