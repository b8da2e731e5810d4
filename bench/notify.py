"""Wake-up latency of a server-side wait against polling loops measured in the same run.

    .venv/bin/python bench/notify.py             # make bench
    .venv/bin/python bench/notify.py --quick     # fewer rounds

A local cluster (controller + one memory server, separate processes on loopback). A
waiter process watches an int64 word of a region; this process changes the word with
``fetch_add`` and the waiter notes when it saw the change. Latency is from just before
the ``fetch_add`` is sent to the waiter's return (both read ``CLOCK_MONOTONIC``, one
clock for the whole host). Three waiters, over tcp and over shm:

* ``wait``: ``Region.wait(offset, changed_from=old)``, the server-side wait;
* ``poll``: ``Region.read`` of the word in a tight loop (the lowest latency polling can
  get, at the price of a busy core and a request per iteration);
* ``poll-1ms``: the same loop sleeping 1 ms between reads (a polite polling loop).

For each: the median and 99th percentile latency, the waiter's CPU time per round and
its reads per round. The ratio is the wait's median latency over each polling loop's.
Results go to ``bench/results/notify.json`` and a Markdown table in
``bench/results/notify.md`` (pasted into ``docs/benchmarks.md``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

WORD = 0
SETTLE = 0.005          # seconds between the waiter saying it starts and the change
MODES = ("wait", "poll", "poll-1ms")


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def waiter(address: str, token: str, name: str, transport: str, mode: str, rounds: int, conn: Any) -> None:
    """Child process: ``rounds`` times, say ready, see the word change, report when."""
    import smb_client
    with smb_client.connect(address, token, transport=transport) as c:
        r = c.open_region(name)
        buf = np.zeros(1, np.int64)
        r.wait(WORD, changed_from=-1, timeout=5)     # warm up: connections, tickets
        reads = 0
        c0 = cpu()
        for _ in range(rounds):
            old = int(r.read_into(WORD, buf)[0])
            conn.send("ready")
            if mode == "wait":
                r.wait(WORD, changed_from=old, timeout=60)
            else:
                pause = 0.001 if mode == "poll-1ms" else 0.0
                while int(r.read_into(WORD, buf)[0]) == old:
                    reads += 1
                    if pause:
                        time.sleep(pause)
            conn.send(now())
        conn.send((cpu() - c0, reads))


def measure(cluster: LocalCluster, transport: str, mode: str, rounds: int) -> dict[str, Any]:
    import smb_client
    ctx = mp.get_context("spawn")
    with smb_client.connect(cluster.address, cluster.token, transport="tcp") as c:
        name = f"bench/notify-{transport}-{mode}"
        r = c.create_region(name, 1 << 20, placement="single")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=waiter, args=(cluster.address, cluster.token, name, transport, mode,
                                                rounds, child))
        proc.start()
        lat = []
        try:
            for _ in range(rounds):
                assert parent.recv() == "ready"
                time.sleep(SETTLE)
                t0 = now()
                r.fetch_add(WORD, 1)
                lat.append(parent.recv() - t0)
            cpu_s, reads = parent.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            c.delete_region(name)
    us = np.array(lat) * 1e6
    return {"transport": transport, "mode": mode, "rounds": rounds,
            "median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "cpu_ms_per_round": 1e3 * cpu_s / rounds, "reads_per_round": reads / rounds}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| transport | waiter | median wake-up (µs) | p99 (µs) | waiter CPU per round (ms) | "
           "reads per round | wait / this (median) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        ref = next(x for x in rows if x["transport"] == row["transport"] and x["mode"] == "wait")
        out.append(f"| {row['transport']} | {row['mode']} | {row['median_us']:.0f} | {row['p99_us']:.0f} | "
                   f"{row['cpu_ms_per_round']:.2f} | {row['reads_per_round']:.0f} | "
                   f"{ref['median_us'] / row['median_us']:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 rounds per point instead of 300")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/notify.json"))
    args = ap.parse_args()
    rounds = args.rounds or (50 if args.quick else 300)
    rows = []
    with LocalCluster(servers=1, capacity="64M", log_level="WARNING") as cluster:
        for transport in ("tcp", "shm"):
            for mode in MODES:
                rows.append(measure(cluster, transport, mode, rounds))
                print(f"{transport:4} {mode:9} median {rows[-1]['median_us']:8.0f} us", flush=True)
    md = table(rows)
    print(md)
    result = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "rounds": rounds, "settle_seconds": SETTLE, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
