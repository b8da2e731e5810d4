"""What the repair passes did (:mod:`.repair`): counts by kind, bytes copied and moved,
syncs running; exported to Prometheus with the controller's registry.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smb_server.runtime.metrics import Registry

log = logging.getLogger(__name__)


class RepairMetrics:
    """What the repairs did: counts by kind, bytes copied, syncs running; exported to
    Prometheus when a ``registry`` (the controller's) is given. Thread-safe."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.by_kind: dict[str, int] = {}
        self.synced_bytes = 0
        self.running = 0
        self.moved_bytes = 0       # bytes of copies that left their server (moves)
        self.move_bytes_left = 0   # bytes of copies still to leave theirs (last pass)
        self._lock = threading.Lock()
        self._prom = None
        self._moved = None
        if registry is not None:
            self._moved = registry.counter("smb_controller_moved_bytes_total",
                                           "Bytes of copies moved off their server (evacuations, rebalances)")
            registry.gauge("smb_controller_move_bytes_left", "Bytes of copies still to move (evacuations, "
                           "rebalances), as of the last repair pass", fn=lambda: [((), self.move_bytes_left)])
            self._prom = (
                registry.counter("smb_controller_repairs_total", "Replica-set changes the controller "
                                 "made, by kind (promote, drop, unreachable, redrive, resync, spare, "
                                 "leave, handover, swap, drained)",
                                 ["kind"]),
                registry.counter("smb_controller_repair_bytes_total",
                                 "Bytes memory servers copied to bring copies in step"),
                registry.histogram("smb_controller_repair_seconds",
                                   "Time to bring one copy in step, seconds",
                                   buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 600)))
            registry.gauge("smb_controller_repairs_running", "Copies being synced now",
                           fn=lambda: [((), self.running)])

    def started(self, delta: int) -> None:
        with self._lock:
            self.running += delta

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self.moved_bytes += nbytes
        if self._moved is not None and nbytes:
            self._moved.inc(nbytes)

    def done(self, kind: str, synced_bytes: int = 0, seconds: float = -1.0) -> None:
        with self._lock:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            self.synced_bytes += synced_bytes
        if self._prom is not None:
            repairs, copied, timing = self._prom
            repairs.inc(kind=kind)
            if synced_bytes:
                copied.inc(synced_bytes)
            if seconds >= 0:
                timing.observe(seconds)
