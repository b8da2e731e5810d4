"""The control plane on both state stores: region create/open/delete per second and
barrier latency with 64 and 256 concurrent callers, and the controller's CPU per
operation.

    .venv/bin/python bench/control_plane.py            # 64 and 256 callers, 5 s per run
    .venv/bin/python bench/control_plane.py --quick    # 64 callers, 2 s

For each store (SQLite, the default; etcd, one member on loopback) one controller and
two memory servers run as processes; the callers are threads sharing 16 clients for region
operations, and 8 threads in each of callers/8 processes for barriers (a barrier admits
16 waiters per connection, as from one training worker). Measured:

* ``create/open/delete``: each caller loops create (64 KiB, ``single``), open, delete of
  a region of its own; operations per second of each kind;
* ``barrier``: every caller calls ``Client.barrier`` of one barrier for all of them, 20
  rounds; the time of each call (median and 99th percentile);
* ``cpu``: the controller process's user + system CPU over the run, per region
  operation (and etcd's, for the etcd store);
* reference: gRPC health checks per second against the same controller with the same
  callers (an empty call: the floor any controller call pays); the ratio is region
  operations over health checks.

Results go to ``bench/results/control_plane.json`` and ``bench/results/control_plane.md``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.process_cpu import cpu_seconds  # noqa: E402
from smb_client import Client  # noqa: E402
from smb_server.runtime import health  # noqa: E402
from smb_server.testing import ControllerGroup, EtcdServer  # noqa: E402

KiB = 1 << 10
CLIENTS = 16
BARRIER_ROUNDS = 20
BARRIER_THREADS = 8  # barrier callers per process


def in_threads(n: int, body: Any) -> None:
    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def region_ops(clients: list[Client], callers: int, seconds: float, tag: str) -> dict[str, int]:
    counts = {"create": 0, "open": 0, "delete": 0}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def body(k: int) -> None:
        c = clients[k % len(clients)]
        mine = {"create": 0, "open": 0, "delete": 0}
        n = 0
        while time.monotonic() < stop:
            name = f"bench/{tag}-{k}-{n}"
            n += 1
            c.create_region(name, 64 * KiB, placement="single")
            mine["create"] += 1
            c.open_region(name)
            mine["open"] += 1
            c.delete_region(name)
            mine["delete"] += 1
        with lock:
            for key, v in mine.items():
                counts[key] += v
    in_threads(callers, body)
    return counts


def health_checks(address: str, callers: int, seconds: float) -> int:
    done = [0] * callers
    stop = time.monotonic() + seconds

    def body(k: int) -> None:
        while time.monotonic() < stop:
            assert health.check(address) == "SERVING"
            done[k] += 1
    in_threads(callers, body)
    return sum(done)


def _barrier_process(address: str, token: str, threads: int, callers: int, tag: str,
                     out: Any) -> None:
    """One process's share of the barrier callers (its own gRPC connection)."""
    times: list[float] = []
    lock = threading.Lock()
    with Client(address, token, reconnect_timeout=30) as c:
        def body(k: int) -> None:
            mine = []
            for _ in range(BARRIER_ROUNDS):
                t0 = time.perf_counter()
                c.barrier(f"bench-{tag}", callers, timeout=60)
                mine.append(time.perf_counter() - t0)
            with lock:
                times.extend(mine)
        in_threads(threads, body)
    out.put(times)


def barrier_latency(address: str, token: str, callers: int, tag: str) -> list[float]:
    """Barrier calls of ``callers`` threads spread over processes (a barrier admits
    ``MAX_WAITERS_PER_CALLER`` waiters per connection, as from one training worker)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = callers // BARRIER_THREADS
    workers = [ctx.Process(target=_barrier_process, args=(address, token, BARRIER_THREADS, callers, tag, out))
               for _ in range(procs)]
    for w in workers:
        w.start()
    times: list[float] = []
    for _ in workers:
        times += out.get(timeout=300)
    for w in workers:
        w.join()
    return times


def run_store(kind: str, callers_list: list[int], seconds: float, workdir: Path) -> list[dict[str, Any]]:
    etcd = EtcdServer() if kind == "etcd" else None
    store = etcd.url("bench") if etcd is not None else str(workdir / "controller.db")
    group = ControllerGroup(workdir, store, count=1, extra_args=("--barrier-waits-max", "300"))
    rows = []
    try:
        group.start()
        group.start_server("1G")
        group.start_server("1G")
        ctl = group.procs[0]
        assert ctl is not None
        clients = [Client(group.addresses[0], group.token, reconnect_timeout=30) for _ in range(CLIENTS)]
        try:
            for callers in callers_list:
                ref = health_checks(group.addresses[0], callers, seconds)
                cpu0 = cpu_seconds(ctl.pid)
                etcd0 = cpu_seconds(etcd.proc.pid) if etcd is not None else 0.0
                t0 = time.perf_counter()
                counts = region_ops(clients, callers, seconds, f"{kind}{callers}")
                took = time.perf_counter() - t0
                cpu = cpu_seconds(ctl.pid) - cpu0
                etcd_cpu = cpu_seconds(etcd.proc.pid) - etcd0 if etcd is not None else 0.0
                ops = sum(counts.values())
                lat = sorted(barrier_latency(group.addresses[0], group.token, callers, f"{kind}{callers}"))
                rows.append({
                    "store": kind, "callers": callers, "seconds": round(took, 2),
                    **{f"{k}_per_s": round(v / took, 1) for k, v in counts.items()},
                    "region_ops_per_s": round(ops / took, 1),
                    "health_checks_per_s": round(ref / seconds, 1),
                    "ratio_to_health_checks": round(ops / took / (ref / seconds), 3) if ref else None,
                    "controller_cpu_ms_per_op": round(cpu / ops * 1e3, 3) if ops else None,
                    "etcd_cpu_ms_per_op": round(etcd_cpu / ops * 1e3, 3) if ops and etcd else None,
                    "barrier_median_ms": round(statistics.median(lat) * 1e3, 2),
                    "barrier_p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2),
                })
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for c in clients:
                c.close()
    finally:
        group.stop()
        if etcd is not None:
            etcd.stop()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| store | callers | create/s | open/s | delete/s | health checks/s (ref) | ratio | "
            "controller CPU ms/op | etcd CPU ms/op | barrier median ms | barrier p99 ms |")
    lines = [head, "|" + " --- |" * 11]
    for r in rows:
        etcd_cpu = "-" if r["etcd_cpu_ms_per_op"] is None else f"{r['etcd_cpu_ms_per_op']:.2f}"
        lines.append(f"| {r['store']} | {r['callers']} | {r['create_per_s']:.0f} | {r['open_per_s']:.0f} | "
                     f"{r['delete_per_s']:.0f} | {r['health_checks_per_s']:.0f} | "
                     f"{r['ratio_to_health_checks']:.2f} | {r['controller_cpu_ms_per_op']:.2f} | {etcd_cpu} | "
                     f"{r['barrier_median_ms']:.1f} | {r['barrier_p99_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 callers, 2 s runs")
    parser.add_argument("--stores", default="sqlite,etcd")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    callers, seconds = ([64], 2.0) if args.quick else ([64, 256], 5.0)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for kind in args.stores.split(","):
        with tempfile.TemporaryDirectory(prefix=f"smb-cp-{kind}-") as tmp:
            rows += run_store(kind, callers, seconds, Path(tmp))
    result = {"rows": rows, "machine": f"{platform.node()} ({os.cpu_count()} cpus)",
              "clients": CLIENTS, "barrier_rounds": BARRIER_ROUNDS,
              # the machine may be shared: its 1-minute load average before and after the run
              "load_average": [round(load_before[0], 1), round(os.getloadavg()[0], 1)]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "control_plane.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(rows) + (f"\nLoad average (1 min) before / after the run: {result['load_average'][0]} / "
                              f"{result['load_average'][1]} on {os.cpu_count()} cpus\n")
    with open(os.path.join(args.out, "control_plane.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
