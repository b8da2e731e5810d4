"""Sums owed to ``REDUCE`` requests whose round is not complete yet, parked by chunk
round until the push that completes the round takes them and sends each from its own
thread (:func:`.collective_ops.push`): no thread is woken to send a sum.

A sum is parked, then its round is looked at again: a push that completed the round
meanwhile either took it (and sends it) or left it, and then the parker takes it back
(:meth:`Parked.reclaim`) and sends it itself, so no sum stays parked past its round's
completion. A watchdog thread looks at every parked sum every :data:`RECHECK` seconds
while any is parked (:meth:`Owed.overdue`): one whose deadline passed, whose extent
went, whose connection ended, or whose round completed without a push taking it (as a
wait re-reads its word, :mod:`.waiters`) is taken out and handed back to its owner.
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol

from .waiters import RECHECK

log = logging.getLogger(__name__)

Key = tuple[int, int, int]   # extent id, count word offset (bytes), round


class Owed(Protocol):
    """A parked sum, as its owner (a connection) made it."""

    key: Key

    def send(self) -> None:
        """The round is complete: send the sum now (from the calling thread)."""

    def overdue(self) -> bool:
        """Whether to take it out and :meth:`hand_back` (looked at every RECHECK)."""

    def hand_back(self) -> None:
        """Taken out by the watchdog: its owner answers it (or drops it)."""


class Parked:
    """Owed sums by chunk round: ``park`` one, ``take`` a round's, ``reclaim`` one."""

    def __init__(self, recheck: float = RECHECK) -> None:
        self.recheck = recheck
        self._cond = threading.Condition()
        self._by_key: dict[Key, list[Owed]] = {}
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def park(self, owed: Owed) -> None:
        with self._cond:
            idle = not self._by_key
            self._by_key.setdefault(owed.key, []).append(owed)
            if self._watchdog is None and not self._closed:
                self._watchdog = threading.Thread(target=self._watch, name="smb-parked", daemon=True)
                self._watchdog.start()
            if idle:   # the watchdog sleeps until something is parked
                self._cond.notify()

    def take(self, key: Key) -> list[Owed]:
        """Every sum parked for ``key``, taken out."""
        with self._cond:
            return self._by_key.pop(key, [])

    def reclaim(self, owed: Owed) -> bool:
        """Take ``owed`` back out: False once a push (or the watchdog) took it."""
        with self._cond:
            return self._remove(owed)

    def __len__(self) -> int:
        with self._cond:
            return sum(len(v) for v in self._by_key.values())

    def close(self) -> None:
        """Stop the watchdog; what is parked stays (its connections are closing)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(5.0)

    def _remove(self, owed: Owed) -> bool:
        group = self._by_key.get(owed.key)
        if group is None:
            return False
        for i, other in enumerate(group):
            if other is owed:
                del group[i]
                if not group:
                    del self._by_key[owed.key]
                return True
        return False

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._by_key and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                parked = [o for group in self._by_key.values() for o in group]
            for owed in parked:
                try:
                    if owed.overdue() and self.reclaim(owed):
                        owed.hand_back()
                except Exception:   # one owner's failure must not stop the others' checks
                    log.exception("a parked sum could not be looked at")
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(self.recheck)
