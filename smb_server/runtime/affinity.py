"""The CPU cores a daemon's process runs on (the memory server's ``cpus`` setting).

A memory server's Python request threads share one interpreter lock. Left to roam, they
run on several cores and hand the lock across them, each hand-over a wake-up on another
core with the interpreter's state cold in its cache; on one core the same work costs
about half the CPU (measured: docs/benchmarks.md, "The server path alone"). The
collective's chunk requests over tcp are served in C without that lock, one thread per
connection, and use as many cores as the setting gives (docs/operations.md, "A memory
server's cores"). systemd's ``CPUAffinity=`` does the same for a unit.
"""
from __future__ import annotations

import contextlib
import os

from smb_protocol.errors import InvalidArgument


def parse(text: str) -> set[int]:
    """The cores a list in ``taskset``'s form names (``"2"``, ``"0-3,8"``); an empty
    text names none (no pinning). InvalidArgument for anything else, or for a core this
    host does not have."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high) if high else int(low)
        except ValueError:
            raise InvalidArgument(f"{part!r} is not a core or a range of cores (such as 2 or 0-3)") from None
        if first < 0 or last < first:
            raise InvalidArgument(f"{part!r} is not a range of cores: it must run upwards from 0")
        cores.update(range(first, last + 1))
    have = os.cpu_count() or 1
    missing = sorted(c for c in cores if c >= have)
    if missing:
        raise InvalidArgument(f"core {missing[0]} does not exist here (cores 0-{have - 1})")
    return cores


def pin(text: str) -> set[int] | None:
    """Run every thread of this process, and every thread and process they start from
    now on, on the cores ``text`` names (nothing for an empty text); the cores, or None.
    (Libraries start threads of their own early, gRPC's among them: each is pinned.)"""
    cores = parse(text)
    if not cores:
        return None
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):   # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)
    return cores
