"""Soft Memory Box demo: a local cluster, a master and workers sharing one region.

Starts a controller and two memory servers (separate processes on loopback), then:
the master creates a striped region; worker processes attach to it by name, each
writes its slice, reads everything back, and accumulates a gradient-like vector into
a shared buffer; the master checks the exact sum and prints throughput per transport.
Ctrl-C stops everything cleanly.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

import smb_client
from smb_protocol.units import format_bytes
from smb_server.commands.local_cluster import LocalCluster

MiB = 1 << 20


def worker(address: str, token: str, rank: int, world: int, size: int, transport: str,
           results: mp.Queue) -> None:
    with smb_client.connect(address, token, transport=transport) as c:
        params = c.open_region("demo/params")
        grads = c.open_region("demo/grads")
        counters = c.open_region("demo/counters")
        share = size // world // 4 * 4          # bytes per worker, whole float32 elements
        mine = np.full(share // 4, rank + 1, dtype=np.float32)
        t0 = time.perf_counter()
        params.write(rank * share, mine)
        t_write = time.perf_counter() - t0
        c.barrier("demo/written", world, timeout=60)
        everything = np.empty(size // 4, dtype=np.float32)
        t0 = time.perf_counter()
        params.read_into(0, everything)
        t_read = time.perf_counter() - t0
        ok = all(np.all(everything[r * share // 4:(r + 1) * share // 4] == r + 1) for r in range(world))
        t0 = time.perf_counter()
        grads.accumulate(0, np.full(size // 4, float(rank + 1), dtype=np.float32))
        t_acc = time.perf_counter() - t0
        counters.fetch_add(0, 1)  # a shared iteration counter (aligned stopping)
        c.barrier("demo/accumulated", world, timeout=60)
        results.put((rank, ok, share / t_write, size / t_read, size / t_acc,
                     sorted(set(params.transports().values()))))
        params.close()
        grads.close()
        counters.close()


def run(cluster: LocalCluster, size: int, world: int, transport: str) -> None:
    with cluster.client() as c:
        params = c.create_region("demo/params", size, placement="striped", stripe_unit=MiB)
        grads = c.create_region("demo/grads", size, placement="striped", stripe_unit=MiB)
        grads.write(0, np.zeros(size // 4, np.float32))
        counters = c.create_region("demo/counters", 4096, placement="single")
        print(f"\n[{transport}] master created demo/params and demo/grads: {format_bytes(size)} each, "
              f"striped over {len(params.extents)} memory servers")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(cluster.address, cluster.token, rank, world, size,
                                                  transport, results)) for rank in range(world)]
        for p in procs:
            p.start()
        rows = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        for rank, ok, w, r, a, used in rows:
            print(f"  worker {rank} ({'/'.join(used)}): write {format_bytes(w)}/s  read {format_bytes(r)}/s  "
                  f"accumulate {format_bytes(a)}/s  data {'ok' if ok else 'WRONG'}")
        total = grads.read(dtype="float32")
        expect = sum(range(1, world + 1))
        counter = int(counters.read(0, 8, dtype="int64")[0])
        print(f"  accumulated gradient: every element = {total[0]:g} (expected {expect}), "
              f"{'exact' if np.all(total == expect) else 'MISMATCH'}; iteration counter = {counter}")
        if not (np.all(total == expect) and all(row[1] for row in rows) and counter == world):
            raise SystemExit("demo: wrong result")
        params.close()
        grads.close()
        c.delete_region("demo/params")
        counters.close()
        c.delete_region("demo/grads")
        c.delete_region("demo/counters")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=64 * MiB, help="bytes per region")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print("starting a local cluster: 1 controller + 2 memory servers ...", flush=True)
    try:
        with LocalCluster(servers=2, capacity="1G", log_level="WARNING") as cluster:
            print(f"controller at {cluster.address}; servers:")
            with cluster.client() as c:
                for s in c.list_servers():
                    print(f"  {s.server_id}  {s.grpc_address}  {format_bytes(s.capacity)}  "
                          f"{', '.join(s.endpoints)}")
            for transport in ("tcp", "shm"):
                run(cluster, args.size, args.workers, transport)
            print("\nshutting the cluster down")
    except KeyboardInterrupt:
        print("\ninterrupted: cluster stopped", file=sys.stderr)
        return 130
    print("demo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
