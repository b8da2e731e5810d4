"""``python -m bench.cluster.linkmon``: the byte counters of the switch's ports, sampled.

Runs inside the testbed's switch namespace (:meth:`.testbed.Testbed.monitor_links`).
Every ``--interval`` seconds it reads each port's ``rx_bytes`` and ``tx_bytes`` from
sysfs and appends one JSON line ``[time.time(), [[rx, tx], ...]]`` to ``--out`` (ports
in the order given). A port's *rx* is what its host sent (the host's uplink), its *tx*
what the host received (its downlink). Stops on SIGTERM or SIGINT, after the line
being written. Reading sysfs costs a few microseconds a port: the sampler itself uses
well under 1% of a core at 20 ms.

A sample's time is the middle of its reads, and a sample whose reads took longer than
:data:`MAX_READ` of the interval (the sampler was preempted among them, on a busy
machine) is left out: its counters are not of one moment, and a rate over it and a
short interval after it came out at several times the link's cap. The next sample
covers the bytes over the longer interval.
"""
from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_READ = 0.1   # of the interval: the longest a sample's reads may take (else it is left out)

_stop = False


def _on_signal(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def read(port: str) -> list[int]:
    base = Path("/sys/class/net") / port / "statistics"
    return [int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())]


def sample(ports: list[str], interval: float,
           reader: Callable[[str], list[int]] = read) -> tuple[float, list[list[int]]] | None:
    """``(time, counters)`` of every port, the time the middle of the reads; None when
    the reads took longer than ``MAX_READ * interval`` (module docstring)."""
    before = time.time()
    counters = [reader(p) for p in ports]
    after = time.time()
    if after - before > MAX_READ * interval:
        return None
    return (before + after) / 2, counters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster.linkmon", description=__doc__.split("\n")[0])
    ap.add_argument("--ports", required=True, help="comma-separated port names")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    ap.add_argument("--out", required=True, help="JSON lines file to append to")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    ports = args.ports.split(",")
    next_at = time.monotonic()
    with open(args.out, "a") as out:
        out.write(json.dumps({"ports": ports, "interval": args.interval}) + "\n")
        out.flush()
        while not _stop:
            taken = sample(ports, args.interval)
            if taken is not None:
                out.write(json.dumps(list(taken)) + "\n")
            next_at += args.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
