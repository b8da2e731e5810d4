"""What the loopback throughput benchmarks (``dataplane``, ``persistence``,
``replication``, ``tracing``) share: timing a point, their common options, the machine
they ran on and writing their results.

Throughput is bytes / seconds in MB/s (1e6 bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(fn: Callable[[], None], size: int, seconds: float) -> float:
    """Throughput (MB/s) of one run of ``fn`` (``size`` bytes a call), at least
    ``seconds`` long and at least two calls."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 2:
            return n * size / elapsed / 1e6


def timed(fn: Callable[[], None], size: int, seconds: float, repeats: int) -> float:
    """Best throughput (MB/s) of ``repeats`` runs of ``fn``, each at least ``seconds``."""
    fn()  # warm up: connections, page faults, registrations
    return max((run(fn, size, seconds) for _ in range(repeats)), default=0.0)


def arguments(description: str, name: str) -> argparse.ArgumentParser:
    """The options every one of them has: ``--quick``, ``--seconds``, ``--repeats`` and
    ``--out`` (default ``bench/results/<name>.json``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="fewer sizes, shorter points")
    ap.add_argument("--seconds", type=float, default=0.5, help="minimum length of one run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (best kept)")
    ap.add_argument("--out", default=os.path.join(ROOT, f"bench/results/{name}.json"))
    return ap


def machine() -> dict[str, Any]:
    """Where the numbers were measured: host name, CPUs, Python version."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}


def save(result: dict[str, Any], table: str, out: str) -> None:
    """Write ``result`` as JSON to ``out`` and ``table`` beside it (``.md``)."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
