"""How much CPU the testbed used during a measurement window.

A background thread samples every :data:`PERIOD` seconds the CPU time of the testbed's
processes (``/proc/<pid>/stat``, all threads) and of the whole machine
(``/proc/stat``). Over a window (``time.time()`` timestamps) :meth:`CpuSampler.usage`
gives the cores the testbed's processes kept busy and the machine's busy fraction, to
tell whether links or CPUs bounded a point. The machine may carry other work: its
busy fraction is context, the testbed's cores are what the experiment used.

Where the processes are given roles (``pids`` returns ``{pid: role}``), the cores are
also split by role (servers, workers, ...), and the machine's own time by kind: the
kernel's softirq time (the veth pairs, the shapers, TCP's receive path run there, and
are charged to no process when the kernel accounts interrupt time apart) is what a
per-process sample cannot see.
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

PERIOD = 0.2           # seconds between samples
MAX_SAMPLES = 100_000  # about five hours of samples
HZ = os.sysconf("SC_CLK_TCK")


_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _machine() -> tuple[int, ...]:
    """Jiffies of all CPUs: busy, total, then each of :data:`_KINDS`."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    fields += [0] * (len(_KINDS) - len(fields))
    idle = fields[3] + fields[4]                                # idle + iowait
    total = sum(fields)                                         # guest time is inside user
    return (total - idle, total, *fields)


def _process(pid: int) -> int | None:
    """user + system jiffies of process ``pid`` (all its threads), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class CpuSampler:
    """Samples in a daemon thread from :meth:`start` until :meth:`stop` (or ``with``);
    ``pids`` returns the processes to account (called at every sample), or a mapping of
    them to their roles."""

    def __init__(self, pids: Callable[[], Iterable[int] | Mapping[int, str]], period: float = PERIOD) -> None:
        self.pids = pids
        self.period = period
        self._times: list[float] = []
        self._machine: list[tuple[int, ...]] = []
        self._procs: list[dict[int, int]] = []
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.period + 1)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if len(self._times) < MAX_SAMPLES:
                procs = {}
                pids = self.pids()
                if isinstance(pids, Mapping):
                    self._roles.update(pids)
                for pid in list(pids):
                    jiffies = _process(pid)
                    if jiffies is not None:
                        procs[pid] = jiffies
                self._procs.append(procs)
                self._machine.append(_machine())
                self._times.append(time.time())
            self._stop.wait(self.period)

    def usage(self, t0: float, t1: float) -> dict[str, Any] | None:
        """``{"cores": ..., "machine_busy": ...}`` between ``t0`` and ``t1``: CPU cores the
        testbed's processes used on average (alive at both ends of the window), and the
        busy fraction (0..1) of the whole machine. With roles, also ``"roles"``: cores
        per role; and always ``"machine"``: the machine's cores busy per kind of time
        (user, system, softirq, ...). None when the window holds fewer than two
        samples."""
        times = list(self._times)
        i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1) - 1
        if j - i < 1:
            return None
        seconds = times[j] - times[i]
        a, b = self._procs[i], self._procs[j]
        both = a.keys() & b.keys()
        cores = sum(b[p] - a[p] for p in both) / HZ / seconds
        m0, m1 = self._machine[i], self._machine[j]
        (b0, n0), (b1, n1) = m0[:2], m1[:2]
        out: dict[str, Any] = {
            "cores": cores, "machine_busy": (b1 - b0) / (n1 - n0) if n1 > n0 else 0.0,
            "machine": {k: (y - x) / HZ / seconds for k, x, y in zip(_KINDS, m0[2:], m1[2:], strict=True)
                        if k != "idle"}}
        if self._roles:
            roles: dict[str, float] = {}
            for p in both:
                role = self._roles.get(p, "other")
                roles[role] = roles.get(role, 0.0) + (b[p] - a[p]) / HZ / seconds
            out["roles"] = roles
        return out
