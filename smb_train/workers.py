"""The workers of the digits example: data, model and one function per update scheme,
run by each torchrun process (see :mod:`smb_train.digits`)."""
from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SCHEMES = ("sync", "seasgd", "hybrid")
ALL_SCHEMES = (*SCHEMES, "ddp")
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
    d = load_data()
    np.savez(path, x_train=d["x_train"], y_train=d["y_train"], x_test=d["x_test"], y_test=d["y_test"])


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

    from smb_client.torch import WorkerEnv

    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    data = load_data(args.data)
    tensors = {k: torch.from_numpy(v) for k, v in data.items()}
    ctx = {"env": env, "args": args, "t": tensors, "torch": torch}
    fn = {"sync": _sync, "seasgd": _seasgd, "hybrid": _hybrid, "ddp": _ddp}[args.scheme]
    result = fn(ctx)
    # DDP holds its process group in a reference cycle: the group outlives
    # destroy_process_group() until the collector runs, and freed during the
    # interpreter's exit, gloo's threads abort the process (std::terminate). Free it now.
    gc.collect()
    result.update(scheme=args.scheme, rank=env.rank, world=env.world_size, restarts=env.restart_count)
    if args.result_dir:
        path = Path(args.result_dir) / f"{args.scheme}-rank{env.rank}.json"
        path.write_text(json.dumps(result))
    return result


def train_step(model: Any, opt: Any, x: Any, y: Any, wrapper: Any = None) -> Any:
    """One optimizer step of ``model`` on the samples ``x`` (labels ``y``): the
    gradients zeroed (``wrapper``'s, else the optimizer's), the cross-entropy loss
    backward, ``wrapper.synchronize()`` (the gradients exchanged), ``opt.step()``.
    ``wrapper``: a SyncDataParallel or HybridSEASGD, or None. Returns the loss."""
    import torch.nn.functional as F
    (opt if wrapper is None else wrapper).zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    if wrapper is not None:
        wrapper.synchronize()
    opt.step()
    return loss


def _epoch_batches(torch: Any, n: int, per_step: int, seed: int, epoch: int) -> Any:
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g)[: (n // per_step) * per_step].view(-1, per_step)


def _sync(ctx: dict[str, Any]) -> dict[str, Any]:
    import smb_client
    from smb_client.torch import SharedCounters, SyncDataParallel, open_store
    env, args, t, torch = ctx["env"], ctx["args"], ctx["t"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    prefix = f"{args.job}/sync"
    with smb_client.connect() as client:
        model = make_model(args.seed, args.hidden)
        store = open_store(client, env, prefix, model, placement=args.placement, scheme="sync",
                           workers=world, **_replicas(args))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        steps_per_epoch = len(t["y_train"]) // (world * b)
        total_steps = steps_per_epoch * args.epochs
        counters = SharedCounters(store.region("counters"), rank, world, "master", total_steps, lockstep=True)
        dp = SyncDataParallel(store, rank, world, overlap=not args.no_overlap, counters=counters,
                              compression=getattr(args, "compression", None))
        progress = Progress(rank == 0 and not args.quiet, total_steps, f"sync   x{world}")
        curve: list[tuple[float, int, float]] = []
        client.barrier(f"{prefix}/start", world, timeout=120)
        t0 = time.perf_counter()
        epoch = 0
        while not dp.stop:
            for batch in _epoch_batches(torch, len(t["y_train"]), world * b, args.seed, epoch):
                idx = batch[rank * b:(rank + 1) * b]
                loss = train_step(model, opt, t["x_train"][idx], t["y_train"][idx], dp)
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
        _release_store(store, destroy=rank == 0)
    return result


def _seasgd(ctx: dict[str, Any]) -> dict[str, Any]:
    import smb_client
    from smb_client.torch import SEASGD, SharedCounters, open_store
    env, args, t, torch = ctx["env"], ctx["args"], ctx["t"], ctx["torch"]
    rank, world, b = env.rank, env.world_size, args.batch
    prefix = f"{args.job}/seasgd"
    shard = torch.arange(rank, len(t["y_train"]), world)
    record = bool(getattr(args, "record_steps", False))
    eval_every = int(getattr(args, "eval_every", 0) or 0)
    with smb_client.connect() as client:
        model = make_model(args.seed, args.hidden)
        store = open_store(client, env, prefix, model, placement=args.placement, delta_slots=world,
                           workers=world, **_replicas(args))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        ea = SEASGD(store, rank, world, moving_rate=args.moving_rate, update_interval=args.interval)
        steps_per_epoch = len(shard) // b
        target = steps_per_epoch * args.epochs
        counters = SharedCounters(store.region("counters"), rank, world, args.stop_rule, target)
        progress = Progress(rank == 0 and not args.quiet, target, f"seasgd x{world}")
        evaluator = make_model(args.seed, args.hidden)
        curve: list[tuple[float, int, float]] = []
        # with record_steps: [time.time() at its end, seconds, seconds in the elastic update
        # (reading the global weights, waiting for the last push), seconds publishing the
        # step count, loss] of every step, and the sum of the deltas this worker pushed into
        # the global weights (float64)
        step_log: list[tuple[float, float, float, float, float]] = []
        pushed = torch.zeros(ea.delta.numel(), dtype=torch.float64) if record else None
        smallest = float("inf")   # the smallest largest element of one pushed delta

        def evaluate() -> None:
            store.load_into(evaluator)   # the global weights
            snap = counters.snapshot()
            curve.append((time.perf_counter() - t0, snap["total"] * b,
                          accuracy(evaluator, t["x_test"], t["y_test"])))
        client.barrier(f"{prefix}/start", world, timeout=120)
        t0, start_time = time.perf_counter(), time.time()
        epoch, stop, local_steps = 0, False, 0
        while not stop:
            for batch in _epoch_batches(torch, len(shard), b, args.seed + rank, epoch):
                s0 = time.perf_counter()
                idx = shard[batch]
                loss = train_step(model, opt, t["x_train"][idx], t["y_train"][idx])
                u0 = time.perf_counter()
                if ea.after_step() and pushed is not None:
                    pushed += ea.delta.double()   # being pushed in the background, not changed
                    smallest = min(smallest, float(ea.delta.abs().max()))
                u1 = time.perf_counter()
                local_steps += 1
                progress.update(loss=f"{loss.item():.3f}")
                c0 = time.perf_counter()
                stop = counters.tick()
                if record:
                    done = time.perf_counter()
                    step_log.append((time.time(), done - s0, u1 - u0, done - c0, loss.item()))
                if stop:
                    break
                if rank == 0 and eval_every and local_steps % eval_every == 0:
                    evaluate()
            epoch += 1
            if rank == 0 and not eval_every:
                evaluate()
        ea.close()
        if rank == 0 and eval_every:
            evaluate()
        elapsed = time.perf_counter() - t0
        if pushed is not None and args.result_dir:
            np.save(Path(args.result_dir) / f"seasgd-rank{rank}-pushed.npy", pushed.numpy())
        progress.close()
        counters.finish()
        client.barrier(f"{prefix}/end", world, timeout=120)
        store.load_into(evaluator)
        snap = counters.snapshot()
        # steps: this worker's count in the box (it goes on across torchrun restarts);
        # local_steps: the steps of this process
        result = {"time": elapsed, "steps": counters.count, "local_steps": local_steps,
                  "samples": counters.count * b,
                  "traffic": store.traffic.as_dict(), "updates": ea.updates, "curve": curve,
                  "accuracy": accuracy(evaluator, t["x_test"], t["y_test"]),
                  "local_accuracy": accuracy(model, t["x_test"], t["y_test"]), "counts": snap["counts"],
                  "start_time": start_time}
        if record:
            result.update(step_log=step_log, smallest_delta=smallest if ea.updates else None)
        client.barrier(f"{prefix}/read", world, timeout=120)
        _release_store(store, destroy=rank == 0 and not getattr(args, "keep_store", False))
    return result


def _release_store(store: Any, destroy: bool) -> None:
    """Done with ``store``: ``destroy`` (one worker, after a barrier every worker passes
    once it no longer needs the store) deletes its regions, else this worker's handle
    is closed and the regions stay."""
    if destroy:
        store.destroy()
    else:
        store.close()


def _replicas(args: argparse.Namespace) -> dict[str, Any]:
    """``ParameterStore.create``'s ``replicas`` option, only when asked for (> 1)."""
    replicas = int(getattr(args, "replicas", 1) or 1)
    return {"replicas": replicas} if replicas > 1 else {}


def _init_dist(env: Any) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)


def _hybrid(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import smb_client
    from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, SharedCounters, new_node_groups, open_store
    env, args, t, torch = ctx["env"], ctx["args"], ctx["t"], ctx["torch"]
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
                           placement=args.placement, delta_slots=nodes, workers=nodes, **_replicas(args))
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
            loss = train_step(model, opt, t["x_train"][idx], t["y_train"][idx], hy)
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
        _release_store(store, destroy=rank == 0)
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
    env, args, t, torch = ctx["env"], ctx["args"], ctx["t"], ctx["torch"]
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
            loss = train_step(ddp, opt, t["x_train"][idx], t["y_train"][idx])
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
