"""Where a training step's time goes: named ranges for ``torch.profiler`` and each
step's seconds by phase.

Every memory-box wait a step makes (pushes taking effect, the sum arriving, a barrier)
runs inside :meth:`StepTimes.phase`, which opens a ``torch.profiler.record_function``
range named ``smb::<scheme>.<phase>`` on the waiting thread (so a profiler trace of an
unchanged training loop shows the exchange) and adds the wait to the step's phase.
``compute`` is the rest of the step's wall time: from the end of the previous step's
exchange to the end of this one, less the waits. A wait is counted once: a phase
opened inside another one (a wait made of waits) adds nothing of its own, only its
range, so the phases of a step never add up to more than its wall time.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.profiler import record_function

from smb_protocol.errors import InvalidArgument

log = logging.getLogger(__name__)

#: a step's phases: computing, waiting for pushes to take effect, waiting for the sums
#: (or SEASGD's global weights), waiting at a barrier
PHASES = ("compute", "push", "sum", "barrier")


class StepTimes:
    """Seconds of one worker's steps, by phase.

    ``scheme`` names the ranges (``smb::sync.push``); ``log_every``: log the mean of the
    last ``log_every`` steps every that many steps (0: never); ``writer``: a TensorBoard
    ``SummaryWriter`` (anything with ``add_scalar(tag, value, step)``) that receives every
    step's phases as ``smb/<scheme>/<phase>_seconds``. Used from the training thread.
    """

    def __init__(self, scheme: str, log_every: int = 0, writer: Any = None) -> None:
        self.scheme = scheme
        self.log_every = int(log_every)
        self.writer = writer
        self.steps = 0
        self.last: dict[str, float] = dict.fromkeys(PHASES, 0.0)    # the last step's seconds
        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)   # seconds over every step
        self._waits = dict.fromkeys(PHASES[1:], 0.0)
        self._window = dict.fromkeys(PHASES, 0.0)
        self._since = time.perf_counter()
        self._open = 0   # phases open now (nested ones count in the outermost only)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A wait of phase ``name`` (``push``, ``sum`` or ``barrier``): a profiler range,
        and its seconds added to the current step's, unless it runs inside another
        phase (whose seconds already hold it)."""
        if name not in self._waits:
            raise InvalidArgument(f"unknown phase {name!r}: expected one of {', '.join(self._waits)}")
        with record_function(f"smb::{self.scheme}.{name}"):
            outermost = not self._open
            self._open += 1
            start = time.perf_counter()
            try:
                yield
            finally:
                self._open -= 1
                if outermost:
                    self._waits[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` of a wait timed elsewhere (no range) to the current step's
        phase ``name``."""
        if name not in self._waits:
            raise InvalidArgument(f"unknown phase {name!r}: expected one of {', '.join(self._waits)}")
        self._waits[name] += max(0.0, seconds)

    def end_step(self) -> None:
        """Close the current step: its phases become :attr:`last` and go to the log and
        the writer when asked."""
        now = time.perf_counter()
        wall, self._since = now - self._since, now
        waited = sum(self._waits.values())
        self.last = {"compute": max(0.0, wall - waited), **self._waits}
        self._waits = dict.fromkeys(PHASES[1:], 0.0)
        self.steps += 1
        for k, v in self.last.items():
            self.total[k] += v
            self._window[k] += v
        if self.writer is not None:
            for k, v in self.last.items():
                self.writer.add_scalar(f"smb/{self.scheme}/{k}_seconds", v, self.steps)
        if self.log_every and self.steps % self.log_every == 0:
            n = self.log_every
            log.info("%s steps %d-%d, mean seconds: %s", self.scheme, self.steps - n + 1, self.steps,
                     ", ".join(f"{k} {v / n:.4f}" for k, v in self._window.items()))
            self._window = dict.fromkeys(PHASES, 0.0)

    def mean(self) -> dict[str, float]:
        """Seconds per step by phase, over every step so far."""
        return {k: v / self.steps if self.steps else 0.0 for k, v in self.total.items()}
