"""Weights from a trainer to many readers: publish until every reader holds the version,
against ``torch.distributed.broadcast`` over gloo to the same readers; a reader's 2-way
shard against its full read; readers over shared memory against ``torch.load`` from tmpfs.

    .venv/bin/python bench/weights.py                        # 256 MB, 8 readers, a local cluster
    .venv/bin/python bench/weights.py --quick                # 8 MB, 2 readers: a smoke run
    .venv/bin/python bench/weights.py --controller HOST:7700 --token T --mb 256 --readers 8

A local cluster of ``--servers`` memory servers on loopback unless ``--controller``
names one (the testbed's); readers and the gloo ranks are processes on this host (their
finishing times are read on one clock, ``CLOCK_MONOTONIC``). Figures are medians over
``--rounds``:

* ``publish->all hold``: from just before ``publish`` until the last of the readers,
  each waiting server-side (``Subscriber.next``), holds the version in its own buffers;
  ``broadcast``: from just before rank 0 broadcasts every tensor until the last rank has
  them (after a barrier that lines the ranks up);
* ``full read`` / ``row shard`` / ``column shard``: one reader (``--transport``) reading
  the whole version, part 0 of 2 of every matrix by rows, and by columns;
* ``shm readers`` / ``torch.load``: all readers at once, each reading the whole version
  over shared memory, against each ``torch.load``-ing it from a file in /dev/shm.

Results go to ``bench/results/weights.json`` (``weights-quick.json``) and a Markdown
table to stdout.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.weights_measure import broadcast_all, now, state, time_reads  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

NAME = "bench/weights"
TMPFS = "/dev/shm"
TIMEOUT = 300.0           # seconds any one step may take


def subscriber_proc(address: str, token: str, transport: str, mb: int, rounds: int, q: Any, hq: Any,
                    go: Any) -> None:
    """A reader: each round, say ready, wait server-side for the next version, read it
    into its own arrays and report when it held it."""
    import smb_client
    from smb_client.weights import Subscriber
    with smb_client.connect(address, token, transport=transport) as c:
        sub = Subscriber(c, NAME)
        into = state(mb)
        for r in range(rounds):
            q.put(("ready", r, 0.0))
            snap = sub.next(into, timeout=TIMEOUT)
            hq.put(("held", r, now()))
            assert float(into["layer0.weight"][0, 0]) == float(snap.version)
    # all readers at once over auto (shared memory on the memory servers' host)
    with smb_client.connect(address, token, transport="auto") as c:
        sub = Subscriber(c, NAME)
        q.put(("ready", -1, 0.0))
        go.wait(TIMEOUT)
        t0 = now()
        sub.read(into)
        q.put(("read", -1, now() - t0))


def gloo_proc(rank: int, world: int, port: int, mb: int, rounds: int, q: Any) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors = [torch.from_numpy(a) for a in state(mb, float(rank == 0)).values()]
    for r in range(rounds):
        dist.barrier()
        t0, t1 = broadcast_all(tensors)
        q.put((rank, r, t0, t1))
    dist.destroy_process_group()


def load_proc(path: str, q: Any, go: Any) -> None:
    import torch
    q.put(("ready", 0, 0.0))
    go.wait(TIMEOUT)
    t0 = now()
    torch.load(path)
    q.put(("loaded", 0, now() - t0))


def _all_at_once(procs: list[Any], q: Any, go: Any) -> list[float]:
    """Wait until every reader process is ready (its first message on ``q``), let them
    all go at once (``go``), and return the seconds each one reports (the third item
    of its next message) after they exited."""
    for _ in procs:
        q.get(timeout=TIMEOUT)
    go.set()
    out = [q.get(timeout=TIMEOUT)[2] for _ in procs]
    for p in procs:
        p.join(TIMEOUT)
    return out


def run_publish(address: str, token: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Publish rounds to the reader processes; then the shm round. Returns (publish->all
    hold times, the shm readers' read times of the last round)."""
    import smb_client
    from smb_client.weights import Publisher
    ctx = mp.get_context("spawn")
    q, hq, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    with smb_client.connect(address, token, transport="tcp") as c:
        weights = state(args.mb)
        pub = Publisher.create(c, NAME, weights, versions=3, replicas=args.replicas)
        try:
            procs = [ctx.Process(target=subscriber_proc, args=(address, token, args.transport, args.mb,
                                                               args.rounds, q, hq, go)) for _ in range(args.readers)]
            for p in procs:
                p.start()
            times = []
            for r in range(args.rounds):
                for _ in procs:
                    assert q.get(timeout=TIMEOUT)[:2] == ("ready", r)
                for a in weights.values():
                    a.fill(float(r))
                t0 = now()
                pub.publish(weights, version=r)
                done = [hq.get(timeout=TIMEOUT) for _ in procs]
                times.append(max(t for _, _, t in done) - t0)
            return times, _all_at_once(procs, q, go)
        finally:
            pub.delete()


def run_broadcast(args: argparse.Namespace) -> list[float]:
    import socket
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.readers + 1
    procs = [ctx.Process(target=gloo_proc, args=(r, world, port, args.mb, args.rounds, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=TIMEOUT) for _ in range(world * args.rounds)]
    for p in procs:
        p.join(TIMEOUT)
    out = []
    for r in range(args.rounds):
        t0 = [t for rank, rr, t, _ in got if rr == r and rank == 0][0]
        out.append(max(done for _, rr, _, done in got if rr == r) - t0)
    return out


def run_load(args: argparse.Namespace) -> list[float]:
    import torch
    path = os.path.join(TMPFS, f"smb-bench-weights-{os.getpid()}.pt")
    torch.save({k: torch.from_numpy(v) for k, v in state(args.mb).items()}, path)
    try:
        ctx = mp.get_context("spawn")
        q, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=load_proc, args=(path, q, go)) for _ in range(args.readers)]
        for p in procs:
            p.start()
        return _all_at_once(procs, q, go)
    finally:
        os.unlink(path)


def run_shards(address: str, token: str, args: argparse.Namespace) -> dict[str, float]:
    import smb_client
    from smb_client.weights import Publisher, Subscriber
    with smb_client.connect(address, token, transport="tcp") as c, \
            smb_client.connect(address, token, transport=args.transport) as rc:
        weights = state(args.mb, 1.0)
        pub = Publisher.create(c, NAME + "-shards", weights, versions=2, replicas=args.replicas)
        try:
            pub.publish(weights)
            sub = Subscriber(rc, NAME + "-shards")
            return time_reads(sub, args.mb, args.rounds, expect=weights)
        finally:
            pub.delete()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="MB of float32 weights (default 256)")
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--servers", type=int, default=4, help="memory servers of the local cluster")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--transport", default="tcp", help="the readers' transport in the publish and shard runs")
    ap.add_argument("--controller", default="", help="use this cluster instead of a local one")
    ap.add_argument("--token", default=os.environ.get("SMB_TOKEN", ""))
    ap.add_argument("--quick", action="store_true", help="8 MB, 2 readers, 2 rounds, 2 servers")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.readers, args.rounds, args.servers = 8, 2, 2, 2
    results: dict[str, Any] = {"mb": args.mb, "readers": args.readers, "rounds": args.rounds,
                               "replicas": args.replicas, "transport": args.transport,
                               "host": platform.node(), "cpus": os.cpu_count()}

    def measure(address: str, token: str) -> None:
        hold, shm_reads = run_publish(address, token, args)
        results["publish_to_all_hold_s"] = statistics.median(hold)
        results["all_readers_read_s"] = max(shm_reads)
        results["shards_s"] = run_shards(address, token, args)

    if args.controller:
        measure(args.controller, args.token)
    else:
        with LocalCluster(servers=args.servers, capacity=f"{max(256, 4 * args.mb + 64)}M",
                          log_level="WARNING") as cluster:
            measure(cluster.address, cluster.token)
    results["broadcast_s"] = statistics.median(run_broadcast(args))
    results["torch_load_all_s"] = max(run_load(args))

    s = results["shards_s"]
    rows = [
        ("publish -> all readers hold", results["publish_to_all_hold_s"], "gloo broadcast", results["broadcast_s"]),
        ("row shard (2-way)", s["row shard"], "full read", s["full read"]),
        ("column shard (2-way)", s["column shard"], "full read", s["full read"]),
        (f"{args.readers} readers read (auto: shm)", results["all_readers_read_s"],
         f"{args.readers} x torch.load (tmpfs)", results["torch_load_all_s"]),
    ]
    print(f"\n{args.mb} MB float32, {args.readers} readers, median of {args.rounds}\n")
    print("| measure | seconds | against | seconds | ratio |")
    print("|---|---:|---|---:|---:|")
    for a, ta, b, tb in rows:
        print(f"| {a} | {ta:.4f} | {b} | {tb:.4f} | {ta / tb:.2f} |")
    results["table"] = [dict(measure=a, seconds=ta, against=b, against_seconds=tb) for a, ta, b, tb in rows]
    out = os.path.join(ROOT, "bench", "results", "weights-quick.json" if args.quick else "weights.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwritten to {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
