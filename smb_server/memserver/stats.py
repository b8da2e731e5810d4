"""Counters and latencies of a memory server's data planes.

One root :class:`PlaneStats` per server holds the totals; each plane writes through
its own view from :meth:`PlaneStats.for_transport` (``tcp``, ``shm``, ``rdma``), which
adds to its transport's counters and to the totals. Latencies go to one histogram,
labelled by operation and transport, shared by the root and its views.

What a transport can see: the TCP plane moves every byte itself, so its byte counters
are complete. A shm client copies with memcpy in its own process and an rdma client
reads and writes with one-sided verbs: neither passes through this process, so for
those transports only sessions, descriptor hand-outs (``attach``), server-side
arithmetic (``accumulate``, ``axpy``, ``scale``) and errors are counted here.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from smb_protocol.latency import OP_BUCKETS, SERVER_HISTOGRAM
from smb_server.runtime.metrics import Histogram

log = logging.getLogger(__name__)

#: ``repeats``: retried mutating requests answered with their first answer, not applied again
COUNTERS = ("bytes_read", "bytes_written", "bytes_accumulated", "operations", "errors", "repeats",
            "sessions")
#: counts of the data planes' limits, read with :meth:`PlaneStats.limits` (not part of
#: :meth:`PlaneStats.snapshot` nor of the metrics): connections refused at accept (full,
#: per-peer share, no descriptors), connections dropped for missing their HELLO or frame
#: deadline or failing their TLS handshake, unauthenticated connections ``evicted`` to make
#: room for newer ones (see :mod:`.listener`), and the TCP plane's shared scratch buffers
#: (``scratch_bytes`` allocated and ``scratch_in_use`` lent, both gauges; ``scratch_waits``:
#: requests that waited for one); ``payload_waits``: times the native loop waited for
#: the rest of a frame (with the socket's low-water mark set to a payload, about once
#: per payload that had not come whole)
LIMIT_COUNTS = ("refused", "dropped", "evicted", "scratch_bytes", "scratch_in_use", "scratch_waits",
                "payload_waits")


class PlaneStats:
    """Counters (bytes, operations, errors; ``sessions`` is a gauge) and an operation
    latency histogram. Thread-safe.

    ``transport`` labels this object's latencies; ``parent`` (set by
    :meth:`for_transport`) also receives every count.
    """

    def __init__(self, transport: str = "", parent: PlaneStats | None = None) -> None:
        self.transport = transport
        self._parent = parent
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS + LIMIT_COUNTS, 0)
        self._views: dict[str, PlaneStats] = {}
        self._series: dict[str, Any] = {}   # op -> its latency series
        self.latency: Histogram = parent.latency if parent is not None else Histogram(
            SERVER_HISTOGRAM, "Data-plane operation latency on the server, seconds",
            ["op", "transport"], buckets=OP_BUCKETS)

    def add(self, **counts: int) -> None:
        """Add to named counters (see :data:`COUNTERS`, :data:`LIMIT_COUNTS`); raises
        KeyError for others."""
        with self._lock:
            for name, n in counts.items():
                if name not in self._counts:
                    raise KeyError(f"unknown counter {name!r}; known: "
                                   f"{', '.join(COUNTERS + LIMIT_COUNTS)}")
                self._counts[name] += n
        if self._parent is not None:
            self._parent.add(**counts)

    def observe(self, op: str, seconds: float) -> None:
        """Record one operation's latency (seconds) under this object's transport."""
        series = self._series.get(op)
        if series is None:   # two threads may both look it up: the same series
            series = self._series[op] = self.latency.child(op=op, transport=self.transport or "unknown")
        series.observe(seconds)

    def for_transport(self, name: str) -> PlaneStats:
        """The view a plane of transport ``name`` writes through (made once, then reused)."""
        with self._lock:
            view = self._views.get(name)
            if view is None:
                view = self._views[name] = PlaneStats(name, parent=self)
            return view

    def snapshot(self) -> dict[str, int]:
        """The counters of :data:`COUNTERS` now, by name."""
        with self._lock:
            return {name: self._counts[name] for name in COUNTERS}

    def limits(self) -> dict[str, int]:
        """The counts of :data:`LIMIT_COUNTS` now, by name."""
        with self._lock:
            return {name: self._counts[name] for name in LIMIT_COUNTS}

    def by_transport(self) -> dict[str, dict[str, int]]:
        """The counters of every view made by :meth:`for_transport`, by transport."""
        with self._lock:
            views = dict(self._views)
        return {name: view.snapshot() for name, view in sorted(views.items())}
