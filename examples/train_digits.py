"""Train a small network on scikit-learn's bundled digits through the memory box.

Three update schemes (and torch DistributedDataParallel as a reference):

* ``sync``: gradients accumulated in the memory box, a barrier, averaged gradients
  pulled (:class:`smb_client.torch.SyncDataParallel`);
* ``seasgd``: asynchronous elastic averaging, a global weight buffer and a private
  delta slot per worker (:class:`smb_client.torch.SEASGD`);
* ``hybrid``: gloo all-reduce inside a node, SEASGD across nodes
  (:class:`smb_client.torch.HybridSEASGD`);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, no memory box.

Two ways to run it:

    # launcher: starts a local cluster (unless --controller), then torchrun per scheme
    .venv/bin/python examples/train_digits.py --workers 4 --scheme all
    .venv/bin/smb train --workers 4 --scheme sync

    # one worker of a torchrun job against a running cluster (SMB_CONTROLLER, SMB_TOKEN)
    torchrun --nproc-per-node 4 examples/train_digits.py --scheme sync

Under torchrun rank 0 creates the regions and the others attach by name.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

log = logging.getLogger("train_digits")

SCHEMES = ("sync", "seasgd", "hybrid")
ALL_SCHEMES = SCHEMES + ("ddp",)
TARGET_ACCURACY = 0.95


# -- data and model -------------------------------------------------------------------
def load_data(path: str | None = None) -> dict[str, np.ndarray]:
    """The digits (8×8 images, 10 classes), scaled to [0, 1], split 80/20 (stratified,
    seed 0). ``path`` names a cached ``.npz`` from :func:`save_data`."""
    if path:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def save_data(path: str) -> None:
    np.savez(path, **load_data())


def make_model(seed: int, hidden: int) -> Any:
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


def accuracy(model: Any, x: Any, y: Any) -> float:
    import torch
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# -- one worker -------------------------------------------------------------------------
class Progress:
    """A tqdm bar on rank 0, nothing elsewhere."""

    def __init__(self, show: bool, total: int, desc: str) -> None:
        self.bar = None
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, n: int = 1, **info: Any) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if info:
                self.bar.set_postfix(info, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from smb_client.torch import WorkerEnv

    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    data = load_data(args.data)
    tensors = {k: torch.from_numpy(v) for k, v in data.items()}
    ctx = {"env": env, "args": args, "t": tensors, "F": F, "torch": torch}
    fn = {"sync": _sync, "seasgd": _seasgd, "hybrid": _hybrid, "ddp": _ddp}[args.scheme]
    result = fn(ctx)
    result.update(scheme=args.scheme, rank=env.rank, world=env.world_size)
    if args.result_dir:
        path = Path(args.result_dir) / f"{args.scheme}-rank{env.rank}.json"
        path.write_text(json.dumps(result))
    return result


def _epoch_batches(torch: Any, n: int, per_step: int, seed: int, epoch: int) -> Any:
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g)[: (n // per_step) * per_step].view(-1, per_step)


def _sync(ctx: dict[str, Any]) -> dict[str, Any]:
    import smb_client
    from smb_client.torch import SharedCounters, SyncDataParallel, open_store
    env, args, t, F, torch = ctx["env"], ctx["args"], ctx["t"], ctx["F"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    prefix = f"{args.job}/sync"
    with smb_client.connect() as client:
        model = make_model(args.seed, args.hidden)
        store = open_store(client, env, prefix, model, placement=args.placement, grad_slots=3,
                           workers=world)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        steps_per_epoch = len(t["y_train"]) // (world * b)
        total_steps = steps_per_epoch * args.epochs
        counters = SharedCounters(store.region("counters"), rank, world, "master", total_steps, lockstep=True)
        dp = SyncDataParallel(store, rank, world, overlap=not args.no_overlap, counters=counters)
        progress = Progress(rank == 0 and not args.quiet, total_steps, f"sync   x{world}")
        curve: list[tuple[float, int, float]] = []
        client.barrier(f"{prefix}/start", world, timeout=120)
        t0 = time.perf_counter()
        epoch = 0
        while not dp.stop:
            for batch in _epoch_batches(torch, len(t["y_train"]), world * b, args.seed, epoch):
                idx = batch[rank * b:(rank + 1) * b]
                dp.zero_grad()
                loss = F.cross_entropy(model(t["x_train"][idx]), t["y_train"][idx])
                loss.backward()
                dp.synchronize()
                opt.step()
                progress.update(loss=f"{loss.item():.3f}")
                if dp.stop:
                    break
            epoch += 1
            if rank == 0:
                curve.append((time.perf_counter() - t0, dp.step * world * b,
                              accuracy(model, t["x_test"], t["y_test"])))
        elapsed = time.perf_counter() - t0
        progress.close()
        dp.close()
        counters.finish()
        client.barrier(f"{prefix}/end", world, timeout=120)
        result = {"time": elapsed, "steps": dp.step, "samples": dp.step * b,
                  "traffic": store.traffic.as_dict(), "comm_wait": dp.comm_wait, "curve": curve,
                  "accuracy": accuracy(model, t["x_test"], t["y_test"]),
                  "overlap": not args.no_overlap}
        if rank == 0:
            store.destroy()
        else:
            store.close()
    return result


def _seasgd(ctx: dict[str, Any]) -> dict[str, Any]:
    import smb_client
    from smb_client.torch import SEASGD, SharedCounters, open_store
    env, args, t, F, torch = ctx["env"], ctx["args"], ctx["t"], ctx["F"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    prefix = f"{args.job}/seasgd"
    shard = torch.arange(rank, len(t["y_train"]), world)
    with smb_client.connect() as client:
        model = make_model(args.seed, args.hidden)
        store = open_store(client, env, prefix, model, placement=args.placement, delta_slots=world,
                           workers=world)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        ea = SEASGD(store, rank, world, moving_rate=args.moving_rate, update_interval=args.interval)
        steps_per_epoch = len(shard) // b
        target = steps_per_epoch * args.epochs
        counters = SharedCounters(store.region("counters"), rank, world, args.stop_rule, target)
        progress = Progress(rank == 0 and not args.quiet, target, f"seasgd x{world}")
        evaluator = make_model(args.seed, args.hidden)
        curve: list[tuple[float, int, float]] = []
        client.barrier(f"{prefix}/start", world, timeout=120)
        t0 = time.perf_counter()
        epoch, stop = 0, False
        while not stop:
            for batch in _epoch_batches(torch, len(shard), b, args.seed + rank, epoch):
                idx = shard[batch]
                opt.zero_grad()
                loss = F.cross_entropy(model(t["x_train"][idx]), t["y_train"][idx])
                loss.backward()
                opt.step()
                ea.after_step()
                progress.update(loss=f"{loss.item():.3f}")
                if counters.tick():
                    stop = True
                    break
            epoch += 1
            if rank == 0:
                store.load_into(evaluator)   # the global weights
                snap = counters.snapshot()
                curve.append((time.perf_counter() - t0, snap["total"] * b,
                              accuracy(evaluator, t["x_test"], t["y_test"])))
        ea.close()
        elapsed = time.perf_counter() - t0
        progress.close()
        counters.finish()
        client.barrier(f"{prefix}/end", world, timeout=120)
        store.load_into(evaluator)
        snap = counters.snapshot()
        result = {"time": elapsed, "steps": counters.count, "samples": counters.count * b,
                  "traffic": store.traffic.as_dict(), "updates": ea.updates, "curve": curve,
                  "accuracy": accuracy(evaluator, t["x_test"], t["y_test"]),
                  "local_accuracy": accuracy(model, t["x_test"], t["y_test"]), "counts": snap["counts"]}
        client.barrier(f"{prefix}/read", world, timeout=120)
        if rank == 0:
            store.destroy()
        else:
            store.close()
    return result


def _init_dist(env: Any) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)


def _hybrid(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import smb_client
    from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, SharedCounters, new_node_groups, open_store
    env, args, t, F, torch = ctx["env"], ctx["args"], ctx["t"], ctx["F"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    _init_dist(env)
    local = args.node_size or env.local_world_size
    if local == world and world > 1 and not args.node_size:
        local = max(1, world // 2)   # one host: simulate two nodes
    groups_ranks, groups = new_node_groups(world, local)
    node, nodes = rank // local, world // local
    local_rank = rank % local
    prefix = f"{args.job}/hybrid"
    shard = torch.arange(node, len(t["y_train"]), nodes)
    model = make_model(args.seed, args.hidden)
    flat = FlatModel(model)
    client = store = seasgd = counters = None
    if local_rank == 0:
        client = smb_client.connect()
        store = open_store(client, env, prefix, flat, members=nodes, creator=node == 0,
                           placement=args.placement, delta_slots=nodes, workers=nodes)
        seasgd = SEASGD(store, node, nodes, moving_rate=args.moving_rate, update_interval=args.interval)
    steps_per_epoch = len(shard) // (local * b)
    target = steps_per_epoch * args.epochs
    if store is not None:
        counters = SharedCounters(store.region("counters"), node, nodes, args.stop_rule, target)
    hy = HybridSEASGD(flat, groups[node], groups_ranks[node], seasgd=seasgd,
                      update_interval=args.interval, overlap=not args.no_overlap)
    hy.broadcast_params()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    progress = Progress(rank == 0 and not args.quiet, target, f"hybrid {nodes}x{local}")
    evaluator = make_model(args.seed, args.hidden)
    curve: list[tuple[float, int, float]] = []
    dist.barrier()
    t0 = time.perf_counter()
    epoch, stop, steps = 0, False, 0
    while not stop:
        for batch in _epoch_batches(torch, len(shard), local * b, args.seed + node, epoch):
            idx = shard[batch[local_rank * b:(local_rank + 1) * b]]
            hy.zero_grad()
            loss = F.cross_entropy(model(t["x_train"][idx]), t["y_train"][idx])
            loss.backward()
            hy.synchronize()
            opt.step()
            hy.after_step()
            steps += 1
            progress.update(loss=f"{loss.item():.3f}")
            if hy.agree(counters is not None and counters.tick()):
                stop = True
                break
        epoch += 1
        if rank == 0:
            assert store is not None and counters is not None
            store.load_into(evaluator)
            curve.append((time.perf_counter() - t0, counters.snapshot()["total"] * local * b,
                          accuracy(evaluator, t["x_test"], t["y_test"])))
    hy.close()
    elapsed = time.perf_counter() - t0
    progress.close()
    result: dict[str, Any] = {"time": elapsed, "steps": steps, "samples": steps * b, "curve": curve,
                              "traffic": {"sent": 0, "received": 0, "ops": 0}, "nodes": nodes, "node_size": local}
    if seasgd is not None:
        seasgd.close()
    if store is not None:
        assert counters is not None and client is not None
        counters.finish()
        client.barrier(f"{prefix}/end", nodes, timeout=120)
        store.load_into(evaluator)
        result.update(traffic=store.traffic.as_dict(), updates=seasgd.updates if seasgd else 0)
        client.barrier(f"{prefix}/read", nodes, timeout=120)
        if rank == 0:
            store.destroy()
        else:
            store.close()
        client.close()
    dist.barrier()
    if rank == 0:
        result["accuracy"] = accuracy(evaluator, t["x_test"], t["y_test"])
    result["local_accuracy"] = accuracy(model, t["x_test"], t["y_test"])
    dist.destroy_process_group()
    return result


def _ddp(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    env, args, t, F, torch = ctx["env"], ctx["args"], ctx["t"], ctx["F"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    _init_dist(env)
    model = make_model(args.seed, args.hidden)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    steps_per_epoch = len(t["y_train"]) // (world * b)
    total_steps = steps_per_epoch * args.epochs
    progress = Progress(rank == 0 and not args.quiet, total_steps, f"ddp    x{world}")
    curve: list[tuple[float, int, float]] = []
    dist.barrier()
    t0 = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        for batch in _epoch_batches(torch, len(t["y_train"]), world * b, args.seed, epoch):
            idx = batch[rank * b:(rank + 1) * b]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(t["x_train"][idx]), t["y_train"][idx])
            loss.backward()
            opt.step()
            steps += 1
            progress.update(loss=f"{loss.item():.3f}")
        if rank == 0:
            curve.append((time.perf_counter() - t0, steps * world * b, accuracy(model, t["x_test"], t["y_test"])))
    elapsed = time.perf_counter() - t0
    progress.close()
    dist.barrier()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    # ring all-reduce: every worker sends and receives 2 (n-1)/n of the gradients per step
    moved = int(2 * (world - 1) / world * nbytes * steps)
    result = {"time": elapsed, "steps": steps, "samples": steps * b, "curve": curve,
              "traffic": {"sent": moved, "received": moved, "ops": steps, "estimated": True},
              "accuracy": accuracy(model, t["x_test"], t["y_test"])}
    dist.destroy_process_group()
    return result


# -- launcher ---------------------------------------------------------------------------
def time_to_accuracy(curve: list[list[float]], target: float) -> float | None:
    for elapsed, _samples, acc in curve:
        if acc >= target:
            return elapsed
    return None


def summarize(scheme: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the per-rank results of one scheme."""
    parts = sorted(parts, key=lambda r: r["rank"])
    master = parts[0]
    elapsed = max(r["time"] for r in parts)
    samples = sum(r["samples"] for r in parts)
    moved = sum(r["traffic"]["sent"] + r["traffic"]["received"] for r in parts)
    return {"scheme": scheme, "workers": len(parts), "time": elapsed, "samples": samples,
            "samples_per_s": samples / elapsed if elapsed else 0.0, "accuracy": master["accuracy"],
            "bytes_moved": moved, "estimated_bytes": bool(master["traffic"].get("estimated")),
            "time_to_accuracy": time_to_accuracy(master["curve"], TARGET_ACCURACY),
            "curve": master["curve"], "steps": [r["steps"] for r in parts],
            "overlap": master.get("overlap")}


def run_scheme(scheme: str, workers: int, worker_args: list[str], env: dict[str, str],
               timeout: float = 600.0) -> dict[str, Any]:
    """Run one scheme under torchrun with ``workers`` processes; returns its summary."""
    with tempfile.TemporaryDirectory(prefix="smb-train-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={workers}", str(Path(__file__).resolve()),
               "--scheme", scheme, "--result-dir", out, *worker_args]
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"train_digits: {scheme} workers failed (exit {proc.returncode})")
        parts = [json.loads(p.read_text()) for p in sorted(Path(out).glob(f"{scheme}-rank*.json"))]
    if len(parts) != workers:
        raise SystemExit(f"train_digits: {scheme}: {len(parts)} of {workers} workers reported")
    return summarize(scheme, parts)


def format_table(rows: list[dict[str, Any]]) -> str:
    from smb_client.units import format_bytes
    head = ["scheme", "workers", "time (s)", "samples/s", "test accuracy", f"time to {TARGET_ACCURACY:.2f} (s)",
            "bytes moved"]
    lines = [head]
    for r in rows:
        tta = r["time_to_accuracy"]
        moved = format_bytes(r["bytes_moved"]) + (" (est.)" if r["estimated_bytes"] else "")
        lines.append([r["label"] if "label" in r else r["scheme"], str(r["workers"]), f"{r['time']:.2f}",
                      f"{r['samples_per_s']:,.0f}", f"{r['accuracy']:.3f}",
                      "-" if tta is None else f"{tta:.2f}", moved])
    widths = [max(len(x) for x in col) for col in zip(*lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines)


def worker_argv(args: argparse.Namespace, data: str) -> list[str]:
    out = ["--data", data, "--job", args.job, "--epochs", str(args.epochs), "--batch", str(args.batch),
           "--lr", str(args.lr), "--momentum", str(args.momentum), "--hidden", str(args.hidden),
           "--seed", str(args.seed), "--placement", args.placement, "--interval", str(args.interval),
           "--stop-rule", args.stop_rule, "--node-size", str(args.node_size)]
    if args.moving_rate is not None:
        out += ["--moving-rate", str(args.moving_rate)]
    if args.no_overlap:
        out.append("--no-overlap")
    if args.quiet:
        out.append("--quiet")
    return out


def launch(args: argparse.Namespace) -> int:
    from smb_client.units import format_bytes
    schemes = list(SCHEMES) if args.scheme == "all" else [args.scheme]
    cluster = None
    controller, token = args.controller, args.token or os.environ.get("SMB_TOKEN", "")
    if not controller:
        from smb_server.local_cluster import LocalCluster
        print("starting a local cluster: 1 controller + 2 memory servers ...", flush=True)
        cluster = LocalCluster(servers=2, capacity="512M", log_level="WARNING").start()
        controller, token = cluster.address, cluster.token
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="smb-digits-") as tmp:
            data = str(Path(tmp) / "digits.npz")
            save_data(data)
            env = dict(os.environ, SMB_CONTROLLER=controller, SMB_TOKEN=token, OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            for scheme in schemes:
                print(f"\n[{scheme}] {args.workers} workers under torchrun, {args.epochs} epochs, "
                      f"{args.placement} parameter store", flush=True)
                row = run_scheme(scheme, args.workers, worker_argv(args, data), env)
                rows.append(row)
                tta = row["time_to_accuracy"]
                print(f"[{scheme}] {row['time']:.2f} s, {row['samples_per_s']:,.0f} samples/s, "
                      f"test accuracy {row['accuracy']:.3f}"
                      + (f" (reached {TARGET_ACCURACY} after {tta:.2f} s)" if tta is not None else "")
                      + f", {format_bytes(row['bytes_moved'])} moved", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    print("\n" + format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.min_accuracy:
        for row in rows:
            if row["scheme"] == "sync" and row["accuracy"] < args.min_accuracy:
                print(f"sync reached only {row['accuracy']:.3f} < {args.min_accuracy}", file=sys.stderr)
                return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="all", choices=("all",) + ALL_SCHEMES)
    p.add_argument("--workers", type=int, default=4, help="worker processes (launcher)")
    p.add_argument("--controller", default=None,
                   help="controller host:port of a running cluster (launcher; default: a local cluster)")
    p.add_argument("--token", default=None, help="bearer token (default $SMB_TOKEN)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", default="striped", choices=("striped", "layered", "single"))
    p.add_argument("--interval", type=int, default=4, help="SEASGD update interval (steps)")
    p.add_argument("--moving-rate", type=float, default=None, help="SEASGD moving rate (default 0.9/workers)")
    p.add_argument("--stop-rule", default="average", choices=("master", "fastest", "average"),
                   help="when asynchronous workers stop")
    p.add_argument("--node-size", type=int, default=0,
                   help="hybrid: workers per node (default LOCAL_WORLD_SIZE; half the workers on one host)")
    p.add_argument("--no-overlap", action="store_true", help="push gradients after backward, not from hooks")
    p.add_argument("--job", default="digits", help="region namespace")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="launcher: exit 1 if sync ends below this test accuracy")
    p.add_argument("--json", default=None, help="launcher: write the summary rows here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("SMB_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "RANK" in os.environ:   # a torchrun worker
        if args.scheme == "all":
            raise SystemExit("under torchrun pass one --scheme (sync, seasgd, hybrid or ddp)")
        run_worker(args)
        return 0
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
