"""What the benchmarks measure of a process and the machine: its CPU seconds from
``/proc`` (all its threads), the cores it may run on, a loopback socket's copy rate
(the reference the data-path benchmarks report ratios to), and the split of a server's
CPU into a part per byte and a part per request."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping

import numpy as np

TICK = os.sysconf("SC_CLK_TCK")


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    return sum(cpu_split(pid))


def pin(pid: int, cores: Iterable[int]) -> None:
    """Run every thread of process ``pid`` on ``cores`` (threads it starts later inherit
    the core of the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):   # the thread ended meanwhile
            os.sched_setaffinity(int(tid), list(cores))


def raw_socket_rate(nbytes: int) -> float:
    """MB/s of one loopback TCP connection moving ``nbytes`` one way (best of 3)."""
    payload, best = memoryview(bytearray(nbytes)), 0.0
    for _ in range(3):
        with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as s:
            conn, buf = srv.accept()[0], bytearray(1 << 20)
            t = threading.Thread(target=s.sendall, args=(payload,))
            start, got = time.perf_counter(), 0
            t.start()
            while got < nbytes:
                got += conn.recv_into(buf)
            best = max(best, nbytes / (time.perf_counter() - start) / 1e6)
            t.join()
            conn.close()
    return best


def fit(runs: Iterable[Mapping[str, float]]) -> tuple[float, float]:
    """Least-squares CPU seconds = a * GB served + b * chunk requests over ``runs`` (each
    with ``served_GB``, ``chunk_requests``, ``server_cpu_s``): a in CPU-s per GB, b in
    ms per chunk request (a push and its sum)."""
    rows = list(runs)
    x = np.array([[r["served_GB"], r["chunk_requests"]] for r in rows])
    y = np.array([r["server_cpu_s"] for r in rows])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(a), float(b) * 1e3


def fit_line(runs: Iterable[Mapping[str, float]]) -> dict[str, object]:
    """:func:`fit` as the JSON line the benchmarks print."""
    per_gb, per_chunk = fit(runs)
    return {"fit": "server CPU = a * GB in and out + b * chunk requests",
            "cpu_s_per_GB": round(per_gb, 3), "ms_per_chunk": round(per_chunk, 4)}


def write_lines(path: str | None, lines: Iterable[Mapping[str, object]], append: bool = False) -> None:
    """The printed results as JSON lines in ``path`` (nothing without one)."""
    if path:
        with open(path, "a" if append else "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
