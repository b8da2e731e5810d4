"""Scratch buffers for request payloads that are received before they are applied
(arithmetic operands, replicated writes, collective chunks): lent per request from a
pool bounded in bytes across all of a plane's connections."""
from __future__ import annotations

import threading
import time

from .stats import PlaneStats

SCRATCH_BYTES = 4 << 20   # bytes of payload received per accumulate step (one pooled buffer)
SMALL_SCRATCH = 64 << 10  # bytes; payloads up to this use a buffer of their own, dropped after use
SCRATCH_POOL_BYTES = 64 << 20  # bytes of pooled scratch buffers a plane may hold in all
SCRATCH_KEEP = 2          # idle pooled buffers kept for reuse; the others are freed


class ScratchPool:
    """Scratch buffers of ``chunk`` bytes lent to connections for one request each; at
    most ``limit`` bytes of them exist at once (at least one buffer), and at most
    :data:`SCRATCH_KEEP` idle ones are kept. ``stats`` counts them (see
    :data:`.stats.LIMIT_COUNTS`). Thread-safe.
    """

    def __init__(self, limit: int = SCRATCH_POOL_BYTES, chunk: int = SCRATCH_BYTES,
                 stats: PlaneStats | None = None) -> None:
        self.chunk = chunk
        self.limit = max(int(limit), chunk)
        self.stats = stats if stats is not None else PlaneStats("tcp")
        self.allocated = 0           # bytes
        self._idle: list[bytearray] = []
        self._cond = threading.Condition()

    def acquire(self, deadline: float) -> bytearray:
        """A buffer of :attr:`chunk` bytes; waits for one until ``deadline`` (a
        :func:`time.monotonic` time), then raises TimeoutError."""
        with self._cond:
            waited = False
            while not self._idle and self.allocated + self.chunk > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no scratch buffer free ({self.allocated} bytes lent)")
                if not waited:
                    self.stats.add(scratch_waits=1)
                    waited = True
                self._cond.wait(left)
            if self._idle:
                buf = self._idle.pop()
            else:
                buf = bytearray(self.chunk)
                self.allocated += self.chunk
                self.stats.add(scratch_bytes=self.chunk)
        self.stats.add(scratch_in_use=1)
        return buf

    def release(self, buf: bytearray) -> None:
        """Give a buffer from :meth:`acquire` back."""
        self.stats.add(scratch_in_use=-1)
        with self._cond:
            if len(self._idle) < SCRATCH_KEEP:
                self._idle.append(buf)
            else:
                self.allocated -= len(buf)
                self.stats.add(scratch_bytes=-len(buf))
            self._cond.notify()

    def close(self) -> None:
        """Free the idle buffers."""
        with self._cond:
            freed = sum(len(b) for b in self._idle)
            self._idle.clear()
            self.allocated -= freed
        if freed:
            self.stats.add(scratch_bytes=-freed)
