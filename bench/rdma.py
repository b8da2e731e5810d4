"""RDMA data-plane bandwidth and atomics against perftest, on the same rxe device.

Runs inside the Soft-RoCE VM (tests/rdma/run_vm.sh runs it after the test tier):

    .venv/bin/python bench/rdma.py --out bench/results/rdma.json

For each message size (64 KiB, 1 MiB) it measures ``ib_write_bw``/``ib_read_bw``
(client and server on rxe0, GID index of 127.0.0.1, ``-F``, fixed iteration counts,
default 128 outstanding WRs on one QP) and then the client library against a local
cluster with one memory server, two ways:

- *matched* (the compared number): perftest's settings: one queue pair, work requests
  of ``size`` bytes (``transport_options={"max_message": size}``), up to 128 in flight,
  a completion requested every 32; one ``Region.write``/``read_into`` of
  ``BUFFER_BYTES``.
- *per operation*: ``chunk_bytes=size``, so every ``size`` piece is its own operation
  (one RDMA WRITE/READ, its own completion wait), with ``--connections`` queue pairs
  driven from the client's I/O threads: what many small independent calls cost.

Atomics: ``Region.fetch_add_many`` of ``ATOMIC_BATCH`` adds on one word (pipelined on
one queue pair, up to 128 in flight) beside ``ib_atomic_bw`` (pipelined), and one
``fetch_add`` call at a time. Bandwidth is bytes / seconds (MB = 1e6 bytes), as perftest reports it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from smb_protocol.rdma import verbs  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

log = logging.getLogger(__name__)

SIZES = (64 << 10, 1 << 20)          # bytes per message
BUFFER_BYTES = 32 << 20              # bytes moved per client measurement
REPEATS = 3                          # client measurements per point (best kept)
PERF_ITERS = {64 << 10: 500, 1 << 20: 64}
ATOMIC_SECONDS = 3.0
ATOMIC_BATCH = 1024                  # fetch-adds per fetch_add_many call
PORT_BASE = 18515


def gid_index(device: str) -> int:
    with verbs.Device(device) as d:
        return d.info.gid.index


def perftest(tool: str, size: int, device: str, gid: int, port: int, extra: list[str]) -> dict:
    """Run a perftest server and client on this host; returns the client's report."""
    args = [tool, "-d", device, "-x", str(gid), "-F", "-p", str(port), *extra]
    if size:
        args += ["-s", str(size)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    try:
        out = ""
        for _ in range(10):
            client = subprocess.run(args + ["127.0.0.1"], capture_output=True, text=True, timeout=300)
            out = client.stdout + client.stderr
            if client.returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{' '.join(args)} failed:\n{out}")
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 5 and re.fullmatch(r"\d+", cols[0]) and re.fullmatch(r"\d+", cols[1]):
            return {"bytes": int(cols[0]), "iterations": int(cols[1]), "peak_MBps": float(cols[2]),
                    "avg_MBps": float(cols[3]), "Mpps": float(cols[4])}
    raise RuntimeError(f"no result line in {tool} output:\n{out}")


def client_bandwidth(cluster: LocalCluster, size: int, connections: int, matched: bool) -> dict:
    """Best write and read MB/s of ``BUFFER_BYTES`` moved as ``size``-byte work requests
    (``matched``: one operation, one QP, pipelined) or ``size``-byte operations."""
    buf = np.random.default_rng(0).integers(0, 256, BUFFER_BYTES, dtype=np.uint8)
    out = np.empty_like(buf)
    if matched:
        opts = dict(chunk_bytes=BUFFER_BYTES, connections=1, transport_options={"max_message": size})
    else:
        opts = dict(chunk_bytes=size, connections=connections, io_threads=max(16, connections))
    with cluster.client(transport="rdma", **opts) as c:
        r = c.create_region(f"bench/rdma-{size}", BUFFER_BYTES, placement="single")
        r.write(0, buf)                       # warm up: connections, registrations
        r.read_into(0, out)
        best = {"write": 0.0, "read": 0.0}
        for _ in range(REPEATS):
            t = time.perf_counter()
            r.write(0, buf)
            best["write"] = max(best["write"], BUFFER_BYTES / (time.perf_counter() - t) / 1e6)
            t = time.perf_counter()
            r.read_into(0, out)
            best["read"] = max(best["read"], BUFFER_BYTES / (time.perf_counter() - t) / 1e6)
        assert np.array_equal(out, buf), "read back differs"
        r.close()
        c.delete_region(f"bench/rdma-{size}")
    return best


def client_atomics(cluster: LocalCluster, batch: int) -> float:
    """fetch_add calls per second on one word: one at a time (``batch`` 1) or
    ``Region.fetch_add_many`` of ``batch`` (pipelined on one queue pair)."""
    with cluster.client(transport="rdma", connections=1) as c:
        r = c.create_region("bench/rdma-atomics", 1 << 20, placement="single")
        r.fetch_add(0, 1)
        items = [(0, 1)] * batch
        n = 0
        t = time.perf_counter()
        while time.perf_counter() - t < ATOMIC_SECONDS:
            if batch == 1:
                r.fetch_add(0, 1)
            else:
                r.fetch_add_many(items)
            n += batch
        rate = n / (time.perf_counter() - t)
        assert r.fetch_add(0, 0) == n + 1
        r.close()
        c.delete_region("bench/rdma-atomics")
    return rate


def table(results: dict) -> str:
    rows = ["| operation | size | smb rdma, matched (MB/s) | perftest (MB/s) | ratio | target "
            "| smb rdma, per operation (MB/s) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for size in SIZES:
        for op in ("write", "read"):
            p = results["bandwidth"][str(size)][op]
            target = 0.9 if size >= 1 << 20 else 0.5
            rows.append(f"| RDMA {op} | {size >> 10} KiB | {p['smb_MBps']:.1f} | {p['perftest_MBps']:.1f} "
                        f"| {p['ratio']:.2f} | {target} | {p['per_op_MBps']:.1f} |")
    a = results["atomics"]
    rows.append(f"| fetch_add, `fetch_add_many` of {ATOMIC_BATCH} | 8 B | {a['smb_ops_per_s']:.0f} ops/s | "
                f"{a['perftest_ops_per_s']:.0f} ops/s | {a['ratio']:.2f} | - | "
                f"{a['one_at_a_time_ops_per_s']:.0f} ops/s (one call each) |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=os.environ.get("SMB_RDMA_DEVICE", "rxe0"))
    ap.add_argument("--connections", type=int, default=8, help="queue pairs per server")
    ap.add_argument("--out", default="bench/results/rdma.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gid = gid_index(args.device)
    results: dict = {"device": args.device, "gid_index": gid, "kernel": platform.release(),
                     "cpus": os.cpu_count(), "buffer_bytes": BUFFER_BYTES,
                     "connections": args.connections, "bandwidth": {}}
    port = PORT_BASE
    with LocalCluster(servers=1, capacity="256M", transports="tcp,rdma", log_level="WARNING",
                      env={"SMB_RDMA_DEVICE": args.device, "SMB_HOST_ID": "bench-server"}) as cluster:
        os.environ["SMB_RDMA_DEVICE"] = args.device
        for size in SIZES:
            iters = ["-n", str(PERF_ITERS[size])]
            pw = perftest("ib_write_bw", size, args.device, gid, port, iters)
            pr = perftest("ib_read_bw", size, args.device, gid, port + 1, iters)
            port += 2
            ours = client_bandwidth(cluster, size, args.connections, matched=True)
            per_op = client_bandwidth(cluster, size, args.connections, matched=False)
            results["bandwidth"][str(size)] = {
                op: {"smb_MBps": ours[op], "perftest_MBps": p["avg_MBps"], "per_op_MBps": per_op[op],
                     "ratio": ours[op] / p["avg_MBps"] if p["avg_MBps"] else 0.0, "perftest": p}
                for op, p in (("write", pw), ("read", pr))}
            print(f"{size >> 10} KiB: write {ours['write']:.1f} vs {pw['avg_MBps']:.1f} MB/s, "
                  f"read {ours['read']:.1f} vs {pr['avg_MBps']:.1f} MB/s "
                  f"(per operation: write {per_op['write']:.1f}, read {per_op['read']:.1f})", flush=True)
        pa = perftest("ib_atomic_bw", 0, args.device, gid, port, ["-A", "FETCH_AND_ADD", "-n", "2000"])
        rate = client_atomics(cluster, ATOMIC_BATCH)
        single = client_atomics(cluster, 1)
        results["atomics"] = {"smb_ops_per_s": rate, "one_at_a_time_ops_per_s": single,
                              "batch": ATOMIC_BATCH, "perftest_ops_per_s": pa["Mpps"] * 1e6,
                              "ratio": rate / (pa["Mpps"] * 1e6) if pa["Mpps"] else 0.0, "perftest": pa}
    print(table(results))
    results["table_markdown"] = table(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
