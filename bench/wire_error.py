"""How far 16-bit gradient exchange lands from the exact sum, measured.

Every worker holds a gradient like a training step's (layers of different scales, a part
common to the workers and a part of each worker's own batch). The same gradients are
summed by:

* the memory box's all-reduce in float32 (``collective float32``);
* the memory box's all-reduce with bf16 or fp16 on the wire: each push rounded to the
  16-bit type, summed in float32 on the server, the sum rounded once (``... wire``) or
  sent back in float32 (``... wire, full sum``);
* gloo's all-reduce of the gradients in bfloat16 and in float16 (what DDP's compress
  hooks hand to the backend: every addition in the ring rounds) and in float32;

each against the float64 sum of the float32 gradients. Reported: the relative error
per element (``|sum - exact| / |exact|``, over elements whose exact sum is not below
1e-6 of the largest), its mean and maximum, and the norm-wise relative error
(``||sum - exact|| / ||exact||``). Workers of the memory box are threads with a client
each, against a local cluster of two memory servers; gloo's are processes on loopback.

    python -m bench.wire_error --workers 4,8 --elements 1000000

Results in ``bench/results/wire_error.json`` and a table on stdout (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = 12
RANKS_TIMEOUT = 600.0   # seconds the memory box's workers get for all their sums together


def gradient(rank: int, n: int, seed: int = 0) -> np.ndarray:
    """Worker ``rank``'s float32 gradient of ``n`` elements: ``LAYERS`` layers whose
    scales spread over three decades, each a common part plus the worker's own."""
    common = np.random.default_rng(seed)
    own = np.random.default_rng(seed + 1 + rank)
    edges = np.linspace(0, n, LAYERS + 1).astype(int)
    out = np.empty(n, np.float32)
    for a, b in zip(edges, edges[1:], strict=False):
        scale = 10 ** common.uniform(-4, -1)
        out[a:b] = scale * (common.standard_normal(b - a) + 0.5 * own.standard_normal(b - a))
    return out


def errors(got: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """Element-wise (mean, max, over the elements whose exact sum is not tiny) and
    norm-wise relative errors of ``got`` against ``exact``."""
    got = got.astype(np.float64)
    diff = np.abs(got - exact)
    keep = np.abs(exact) >= 1e-6 * np.abs(exact).max()
    rel = diff[keep] / np.abs(exact[keep])
    return {"mean": float(rel.mean()), "max": float(rel.max()),
            "norm": float(np.linalg.norm(got - exact) / np.linalg.norm(exact))}


# -- the memory box ----------------------------------------------------------------
def box_sums(workers: int, n: int, workdir: str) -> dict[str, np.ndarray]:
    """Rank 0's sum for every memory-box mode (every rank's is checked equal)."""
    from smb_client.collective import Collective
    from smb_server.commands.local_cluster import LocalCluster
    from smb_server.testing import run_ranks
    modes = {"collective float32": (None, False), "collective bf16 wire": ("bf16", False),
             "collective bf16 wire, full sum": ("bf16", True), "collective fp16 wire": ("fp16", False),
             "collective fp16 wire, full sum": ("fp16", True)}
    with LocalCluster(servers=2, capacity=f"{max(256, 8 * n * 4 // (1 << 20) + 64)}M", workdir=workdir) as cluster, \
            contextlib.ExitStack() as parties:
        clients = [parties.enter_context(cluster.client(transport="tcp")) for _ in range(workers)]
        coll0 = Collective.create(clients[0], "bench/wire", n * 4, workers)
        parties.callback(coll0.destroy)
        colls = [coll0] + [parties.enter_context(Collective.open(c, "bench/wire", workers)) for c in clients[1:]]

        def run(rank: int) -> dict[str, np.ndarray]:
            sums: dict[str, np.ndarray] = {}
            for mode, (wire, full) in modes.items():
                x = gradient(rank, n)
                colls[rank].all_reduce(x, wire=wire, full_sum=full)
                sums[mode] = x
            return sums
        results = run_ranks(workers, run, timeout=RANKS_TIMEOUT)
    for mode in modes:
        for rank in range(1, workers):
            if not np.array_equal(results[rank][mode], results[0][mode]):
                raise AssertionError(f"{mode}: rank {rank}'s sum differs from rank 0's")
    return results[0]


# -- gloo ---------------------------------------------------------------------------
def _gloo_worker(rank: int, workers: int, n: int, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers,
                            timeout=datetime.timedelta(seconds=300))
    try:
        g = torch.from_numpy(gradient(rank, n))
        for name, dtype in (("gloo bfloat16", torch.bfloat16), ("gloo float16", torch.float16),
                            ("gloo float32", torch.float32)):
            t = g.to(dtype)
            dist.all_reduce(t)
            if rank == 0:
                queue.put((name, t.float().numpy()))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(("done", None))


def gloo_sums(workers: int, n: int) -> dict[str, np.ndarray]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, workers, n, port, queue)) for r in range(workers)]
    for p in procs:
        p.start()
    out: dict[str, np.ndarray] = {}
    try:
        while True:
            name, value = queue.get(timeout=600)
            if name == "done":
                break
            out[name] = value
    finally:
        for p in procs:
            p.join(60)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a gloo worker failed: exit codes {[p.exitcode for p in procs]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wire_error", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="4,8", help="worker counts, comma-separated")
    ap.add_argument("--elements", type=int, default=1_000_000, help="float32 elements per gradient")
    ap.add_argument("--out", default="bench/results/wire_error.json")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"elements": args.elements, "points": []}
    for workers in (int(w) for w in args.workers.split(",")):
        print(f"{workers} workers: the memory box ...", file=sys.stderr, flush=True)
        exact = np.sum([gradient(r, args.elements).astype(np.float64) for r in range(workers)], axis=0)
        with tempfile.TemporaryDirectory(prefix="smb-wire-") as workdir:
            sums = box_sums(workers, args.elements, workdir)
        print(f"{workers} workers: gloo ...", file=sys.stderr, flush=True)
        sums.update(gloo_sums(workers, args.elements))
        point = {"workers": workers, "errors": {name: errors(got, exact) for name, got in sums.items()}}
        report["points"].append(point)
        print(f"\n{workers} workers, {args.elements} elements: relative error against the float64 sum")
        print("| exchange | mean | max | norm-wise |")
        print("| --- | ---: | ---: | ---: |")
        for name, e in point["errors"].items():
            print(f"| {name} | {e['mean']:.3g} | {e['max']:.3g} | {e['norm']:.3g} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
