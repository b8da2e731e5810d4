"""Collective round time on loopback: ``all_reduce`` through memory servers on this host,
next to the raw socket's copy rate measured in the same run, and what the servers'
CPU does per byte.

    .venv/bin/python bench/collective_loopback.py                 # 4 workers, 2 servers, 25 MB
    .venv/bin/python bench/collective_loopback.py --workers 2 --mbytes 100
    .venv/bin/python bench/collective_loopback.py --paths streamed,pushpull --repeat 3

A local cluster (controller + ``--servers`` memory servers, separate processes) and
``--workers`` worker processes, each with its own client over tcp, run ``--rounds``
all_reduce rounds of a float32 buffer of ``--mbytes`` MB; each round's sum is checked
exactly (integers). Printed: the median round time (s) and the bytes each worker moves
per second (push + pull), with the reference: one raw TCP socket pair on loopback
moving the same bytes in one direction (MB/s). Used to compare two trees of the
project on one machine (run it in each; nothing else running).

``--paths``: ``streamed`` (``REDUCE`` on pipelined connections, sums streamed back:
the default), ``pushpull`` (a push and a pull per chunk, as before it: chunks of
up to 4 MiB, 8 of each in flight) and, on a host with an RDMA device (the Soft-RoCE
VM), ``rdma`` (the workers' regions open over rdma: chunks RDMA-written into the
servers' staging areas, sums written back) and ``rdma-tcp`` (the same clients, the
collective forced onto tcp: ``transport="tcp"``); with several, they run alternately,
``--repeat`` times each, on one cluster. With ``--perftest``, ``ib_write_bw`` between
two processes on the same device at the collective's chunk size is the reference
(MB/s per direction of one link) besides the raw socket. Server CPU: the memory servers' user+system seconds over
the measured rounds (``/proc``), per GB the servers took in and sent out (every
worker's pushes and sums), as GB/s per core of the server path, and its user part alone
(the server's own code: on Soft-RoCE the system part includes the emulated RDMA device,
which a real NIC does in hardware). Worker CPU: each worker's process CPU (every
thread, ``time.process_time``) inside its measured ``all_reduce`` calls, summed over the
workers, per GB they pushed and received.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import smb_client  # noqa: E402
from bench.process_cpu import cpu_seconds, cpu_split, fit_line, pin, raw_socket_rate, write_lines  # noqa: E402

try:
    from smb_server.commands.local_cluster import LocalCluster  # noqa: E402
except ImportError:   # an older tree, for A/B runs
    from smb_server.local_cluster import LocalCluster  # type: ignore[no-redef]  # noqa: E402


def worker(rank: int, env: dict[str, str], n: int, name: str, parties: int, rounds: int,
           out: mp.Queue, path: str = "streamed", servers: int = 2,  # type: ignore[type-arg]
           chunk_bytes: int | None = None) -> None:
    os.environ.update(env)
    opts: dict[str, object] = {"pushpull": {"pipelined": False}, "rdma-tcp": {"transport": "tcp"}}.get(path, {})
    with smb_client.connect(transport="rdma" if path.startswith("rdma") else "tcp") as c:
        if rank == 0:
            chunk = chunk_bytes or (former_chunk(n, servers) if path == "pushpull" else None)
            coll = smb_client.Collective.create(c, name, n * 4, parties, chunk_bytes=chunk, **opts)
        else:
            coll = None
            deadline = time.monotonic() + 60
            while coll is None:
                try:
                    coll = smb_client.Collective.open(c, name, parties, fresh=True, **opts)   # just created
                except smb_client.errors.RegionNotFound:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        data = np.empty(n, np.float32)
        want = float(parties * (parties + 1) // 2)
        times, spans = [], []
        cpu = 0.0                    # this process's CPU (every thread) in the measured rounds' calls
        for i in range(rounds):
            data.fill(rank + 1)      # all_reduce sums in place
            wall, start, cpu0 = time.time(), time.perf_counter(), time.process_time()
            got = coll.all_reduce(data)
            times.append(time.perf_counter() - start)
            if i:                    # the first round warms up
                cpu += time.process_time() - cpu0
            spans.append((wall, wall + times[-1]))
            if not (got[0] == want and got[-1] == want):
                raise AssertionError(f"rank {rank}: sum {got[0]} != {want}")
        coll.close()
        c.barrier(f"{name}/done", parties=parties)   # every party has its last sum: then delete
        if rank == 0:
            c.delete_region(name)
        out.put((times, spans, cpu))


def former_chunk(n: int, servers: int) -> int:
    """The chunk bytes ``pushpull`` used by default, for ``n`` float32 over ``servers``."""
    return max(64 << 10, min(4 << 20, -(-n * 4 // (servers * 4 * 4096)) * 4096))


def run(lc: LocalCluster, env: dict[str, str], n: int, args: argparse.Namespace, path: str,
        tag: str, chunk_bytes: int | None = None) -> dict[str, float]:
    """One measurement of ``path``: the median round and the servers' CPU per byte
    (``chunk_bytes``: the collective's chunk, None for its default)."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=worker, args=(r, env, n, f"bench/coll-{tag}", args.workers, args.rounds, out,
                                              path, args.servers, chunk_bytes))
             for r in range(args.workers)]
    pids = [lc.server_pid(i) for i in range(args.servers)]
    before = sum(cpu_seconds(p) for p in pids)
    user_before = sum(cpu_split(p)[0] for p in pids)
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"a worker failed (exit codes {failed}); see its traceback above") from None
    after = sum(cpu_seconds(p) for p in pids)
    user = sum(cpu_split(p)[0] for p in pids) - user_before
    for p in procs:
        p.join(60)
    per_round = [max(r[0][i] for r in results) for i in range(args.rounds)][1:]   # the first round warms up
    median = statistics.median(per_round)
    served = 2 * n * 4 * args.workers * args.rounds / 1e9   # GB in (pushes) and out (sums), all rounds
    pushed = 2 * n * 4 * args.workers * (args.rounds - 1) / 1e9   # the same, the workers' measured rounds
    chunk = chunk_bytes or (former_chunk(n, args.servers) if path == "pushpull"
                            else smb_client.Collective.default_chunk(n * 4, args.servers))
    return {"round_s": median, "worker_MBps": 2 * n * 4 / median / 1e6,
            "server_cpu_s": after - before, "served_GB": served,
            "chunk_requests": args.workers * args.rounds * -(-n * 4 // chunk),
            "server_cpu_s_per_GB": (after - before) / served, "server_user_s_per_GB": user / served,
            "server_GBps_per_core": served / (after - before) if after > before else float("nan"),
            "worker_cpu_s_per_GB": sum(r[2] for r in results) / pushed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--mbytes", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--paths", default="streamed", help="streamed and/or pushpull, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="measurements of each path, alternating")
    ap.add_argument("--chunk-kib", default="",
                    help="chunk sizes (KiB, comma-separated) to measure each path at, and fit "
                         "the servers' CPU to a cost per GB plus one per chunk (default: the "
                         "collective's own chunk)")
    ap.add_argument("--perftest", action="store_true", help="ib_write_bw at the chunk size as a reference")
    ap.add_argument("--pin-servers", action="store_true",
                    help="run memory server i on core i (modulo the cores here), as its cpus setting does")
    ap.add_argument("--out", help="also write the results as JSON lines to this file")
    args = ap.parse_args()
    n = int(args.mbytes * 1e6) // 4
    paths = args.paths.split(",")
    chunks = [int(k) << 10 for k in args.chunk_kib.split(",") if k] or [None]
    labels = {(p, c): p if c is None else f"{p}@{c >> 10}KiB" for p in paths for c in chunks}
    got: dict[str, list[dict[str, float]]] = {label: [] for label in labels.values()}
    rdma = any(p.startswith("rdma") for p in paths)
    extra = {"transports": "tcp,rdma", "env": {"SMB_HOST_ID": "bench-server"}} if rdma else {}
    with LocalCluster(args.servers, capacity=max(1 << 30, 8 * n * 4), **extra) as lc:  # type: ignore[arg-type]
        env = {"SMB_CONTROLLER": lc.address, "SMB_TOKEN": lc.token}
        if args.pin_servers:
            for i in range(args.servers):
                pin(lc.server_pid(i), [i % (os.cpu_count() or 1)])
        for k in range(args.repeat):
            for (path, chunk), label in labels.items():
                got[label].append(run(lc, env, n, args, path, f"{path}{k}-{chunk}", chunk))
    raw = raw_socket_rate(n * 4)
    lines = []
    if args.perftest:
        from bench.rdma import gid_index, perftest
        device = os.environ.get("SMB_RDMA_DEVICE", "rxe0")
        chunk = smb_client.Collective.default_chunk(n * 4, args.servers)
        ref = perftest("ib_write_bw", chunk, device, gid_index(device), 18600, ["-n", "200"])
        lines.append({"reference": "ib_write_bw", "chunk_bytes": chunk, "MBps": ref["avg_MBps"]})
        print(json.dumps(lines[-1]))
    for path, runs in got.items():
        median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        lines.append({"path": path, "chunk_bytes": runs[0]["chunk_requests"] and
                      round(n * 4 * args.workers * args.rounds / runs[0]["chunk_requests"]),
                      "workers": args.workers, "servers": args.servers, "mbytes": args.mbytes,
                      "runs": len(runs), "round_s": round(median["round_s"], 4),
                      "rounds_s": [round(r["round_s"], 4) for r in runs],
                      "worker_MBps": round(median["worker_MBps"], 1), "raw_socket_MBps": round(raw, 1),
                      "ratio_to_raw": round(median["worker_MBps"] / raw, 3),
                      "server_cpu_s_per_GB": round(median["server_cpu_s_per_GB"], 3),
                      "server_user_s_per_GB": round(median["server_user_s_per_GB"], 3),
                      "server_GBps_per_core": round(median["server_GBps_per_core"], 2),
                      "worker_cpu_s_per_GB": round(median["worker_cpu_s_per_GB"], 3),
                      "pinned": args.pin_servers})
        print(json.dumps(lines[-1]))
    if len(chunks) > 1:
        lines.append(fit_line(r for runs in got.values() for r in runs))
        print(json.dumps(lines[-1]))
    write_lines(args.out, lines, append=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
