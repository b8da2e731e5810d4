"""Waits on int64 words and leased locks: the memory server's coordination state.

Pure state (threads and events, no sockets). One :class:`Waiters` table per memory
server (its :class:`~.node.Node`'s, shared by its tcp and rdma planes) maps
each watched word (extent id, byte offset) to the requests waiting on it. A wait
registers itself *before* it reads the word, so no change slips between the read and
the sleep: every mutating request a data plane serves (write, accumulate, axpy, scale,
fetch_add, compare_swap, lock, unlock) calls :meth:`Waiters.touched` with its byte range
once it is applied, which wakes the waiters of every word in that range; each re-reads
its word and answers or sleeps again. Writes that bypass the server (one-sided RDMA
writes and atomics, shm ``memcpy``) are noticed by a re-read every :data:`RECHECK`
seconds.

Locks: a lock is an int64 word holding its holder's id (0: free). ``lock`` sets it to
the caller's id when it is free, already the caller's (a renewal), or held under a
lease that ran out; the lease (seconds, on this server's monotonic clock) is kept in
this table, never in the word, so clients need no common clock. A held word this table
has no lease for (a server restarted with a file-backed extent) gets a fresh lease of
the caller's length from the first time it is seen. ``unlock`` clears the word if the
caller holds it, else raises :class:`LockNotHeld`. Both run under the extent's lock, so
they are atomic against fetch_add and compare_swap served by this server.
"""
from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smb_protocol.errors import ExtentNotFound, InvalidArgument, LockNotHeld, ServerUnavailable, Timeout
from smb_protocol.wire import WaitCond

if TYPE_CHECKING:
    from .arena import Extent

log = logging.getLogger(__name__)

RECHECK = 0.05        # seconds between re-reads of a waited word
WAIT_MAX = 3600.0     # seconds one request may wait (clients wait longer in several requests)
LEASE_MIN = 0.01      # seconds
LEASE_MAX = 86400.0   # seconds
_WORD = struct.Struct("<q")

#: Cancelled() -> True once the waiting request's connection or plane went away
Cancelled = Callable[[], bool]
#: Applied(word before) -> None: runs under the extent's lock once a lock word changed
Applied = Callable[[int], None]


def holds(cond: WaitCond, word: int, value: int) -> bool:
    """Whether ``word`` satisfies ``cond`` against ``value``."""
    if cond is WaitCond.AT_LEAST:
        return word >= value
    if cond is WaitCond.EQUAL:
        return word == value
    return word != value


def check_timeout(seconds: float, what: str = "timeout") -> float:
    """``seconds`` if it is a finite number in ``[0, WAIT_MAX]``, else InvalidArgument."""
    if not (math.isfinite(seconds) and 0 <= seconds <= WAIT_MAX):
        raise InvalidArgument(f"{what} must be 0..{WAIT_MAX:g} seconds per request, not {seconds}")
    return seconds


@dataclass
class _Lease:
    holder: int
    expires: float        # time.monotonic()


class Waiters:
    """Watched words and lock leases of one arena. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._words: dict[int, dict[int, set[threading.Event]]] = {}   # extent -> offset -> events
        self._leases: dict[tuple[int, int], _Lease] = {}

    # -- waking ---------------------------------------------------------------------
    def touched(self, extent_id: int, offset: int, length: int) -> None:
        """Wake the waiters of every word overlapping ``[offset, offset+length)`` bytes of
        the extent (called after each mutating request)."""
        if extent_id not in self._words:      # the common case: nobody waits on this extent
            return
        end = offset + length
        with self._lock:
            for off, events in self._words.get(extent_id, {}).items():
                if off < end and offset < off + 8:
                    for event in events:
                        event.set()

    def waiting(self) -> int:
        """Requests waiting now (all extents)."""
        with self._lock:
            return sum(len(e) for words in self._words.values() for e in words.values())

    @contextmanager
    def _watch(self, extent_id: int, offset: int) -> Iterator[threading.Event]:
        event = threading.Event()
        with self._lock:
            self._words.setdefault(extent_id, {}).setdefault(offset, set()).add(event)
        try:
            yield event
        finally:
            with self._lock:
                words = self._words[extent_id]
                words[offset].discard(event)
                if not words[offset]:
                    del words[offset]
                if not words:
                    del self._words[extent_id]

    @staticmethod
    def _sleep(event: threading.Event, seconds: float, extent: Extent, cancelled: Cancelled) -> None:
        event.wait(max(0.0, min(seconds, RECHECK)))
        event.clear()
        if cancelled():
            raise ServerUnavailable("the waiting connection or the data plane closed")
        if not extent.live:
            raise ExtentNotFound(f"extent {extent.extent_id} was released while waited on")

    # -- requests -------------------------------------------------------------------
    def wait(self, extent: Extent, offset: int, cond: WaitCond, value: int, timeout: float,
             cancelled: Cancelled = lambda: False) -> int:
        """Block until the int64 at ``offset`` (bytes, aligned) satisfies ``cond`` against
        ``value``; returns the word. :class:`Timeout` after ``timeout`` seconds."""
        deadline = time.monotonic() + check_timeout(timeout)
        with extent.pin(), self._watch(extent.extent_id, offset) as event:
            while True:
                word = _WORD.unpack_from(extent.data, offset)[0]
                if holds(cond, word, value):
                    return int(word)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"the word at byte {offset} of extent {extent.extent_id} is {word}, "
                                  f"not {cond.describe(value)}, after {timeout:.3g} s")
                self._sleep(event, left, extent, cancelled)

    def lock(self, extent: Extent, offset: int, holder: int, lease: float, timeout: float,
             cancelled: Cancelled = lambda: False, applied: Applied | None = None) -> int:
        """Take (or renew) the lock word at ``offset`` for ``holder`` (non-zero) with a
        lease of ``lease`` seconds, waiting up to ``timeout`` seconds while another holds
        it; returns the word before (0, ``holder`` for a renewal, or the id of a holder
        whose lease ran out). :class:`Timeout` when it stays held. ``applied(before)``
        runs under the extent's lock once the word is set (a replicated extent's primary
        forwards the change there)."""
        if holder == 0:
            raise InvalidArgument("a lock holder id must not be 0 (0 marks a free lock)")
        if not (math.isfinite(lease) and LEASE_MIN <= lease <= LEASE_MAX):
            raise InvalidArgument(f"lease must be {LEASE_MIN:g}..{LEASE_MAX:g} seconds, not {lease}")
        deadline = time.monotonic() + check_timeout(timeout)
        key = (extent.extent_id, offset)
        with extent.pin(), self._watch(*key) as event:
            while True:
                with extent.lock:
                    with self._lock:
                        now = time.monotonic()
                        word = int(_WORD.unpack_from(extent.data, offset)[0])
                        held = self._leases.get(key)
                        if word != 0 and (held is None or held.holder != word):
                            held = self._leases[key] = _Lease(word, now + lease)   # first seen: lease starts
                        taken = word in (0, holder) or held is None or held.expires <= now
                        if taken:
                            if word not in (0, holder):
                                log.info("lock at byte %d of extent %d: lease of holder %#x ran out",
                                         offset, extent.extent_id, word)
                            _WORD.pack_into(extent.data, offset, holder)
                            self._leases[key] = _Lease(holder, now + lease)
                        else:
                            assert held is not None
                            expires = held.expires
                    if taken:
                        if applied is not None:
                            applied(word)
                        break
                left = deadline - now
                if left <= 0:
                    raise Timeout(f"lock at byte {offset} of extent {extent.extent_id} is held by "
                                  f"{word:#x} (lease ends in {expires - now:.3g} s), after {timeout:.3g} s")
                self._sleep(event, min(left, expires - now), extent, cancelled)
        self.touched(extent.extent_id, offset, 8)
        return word

    def unlock(self, extent: Extent, offset: int, holder: int, applied: Applied | None = None) -> int:
        """Free the lock word at ``offset`` if ``holder`` holds it (returns ``holder``);
        else :class:`LockNotHeld`. ``applied(holder)`` runs under the extent's lock once
        the word is cleared."""
        key = (extent.extent_id, offset)
        with extent.pin(), extent.lock:
            with self._lock:
                word = int(_WORD.unpack_from(extent.data, offset)[0])
                if word != holder or holder == 0:
                    raise LockNotHeld(f"lock at byte {offset} of extent {extent.extent_id} is held by "
                                      f"{word:#x}, not by {holder:#x}: its lease ran out or it was never taken")
                _WORD.pack_into(extent.data, offset, 0)
                self._leases.pop(key, None)
            if applied is not None:
                applied(word)
        self.touched(extent.extent_id, offset, 8)
        return word
