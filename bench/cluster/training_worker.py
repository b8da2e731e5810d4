"""The training experiment's worker (mode ``training``), run by :mod:`.worker`.

Synchronous data-parallel training of an MLP whose gradient exchange dominates its
step (``spec["layers"]``: widths; float32), the same model, data and optimizer on
every system, one after the other on the same hosts: ``smb`` (:class:`SyncDataParallel`,
the pipelined push-pull collective, no hooks), ``smb+hooks`` (pushes from the backward
hooks; ``-fifo``: chunks in the order they become ready, not first layers first), ``ddp``
(:class:`torch.nn.parallel.DistributedDataParallel` over gloo) and ``ddp-smb`` (the same
DDP over the ``"smb"`` backend, :mod:`smb_client.torch.backend`); with 16-bit gradients:
``smb+hooks-bf16`` (``compression="bf16"``: bfloat16 on the wire, float32 sums on the
servers) and ``ddp-fp16`` (DDP over gloo with its ``fp16_compress_hook``).
Each system: ``warmup`` steps, a gloo barrier, then ``steps`` timed steps; the
result holds this worker's seconds for them, its time waiting for the exchange
(SyncDataParallel's ``comm_wait``), the wall-clock window (for CPU use) and whether its
weights equal everybody's at the end (the sum of the weights, gathered).
"""
from __future__ import annotations

import datetime
import gc
import os
import time
from typing import Any

BARRIER_TIMEOUT = 300.0   # seconds
#: -fifo: chunks in the order they are ready; ddp-smb: plain DDP on the "smb" torch.distributed backend
SYSTEMS = ("smb", "smb+hooks", "smb+hooks-bf16", "smb+hooks-fifo", "ddp", "ddp-fp16", "ddp-smb")


def make_model(layers: list[int]) -> Any:
    import torch
    torch.manual_seed(0)
    mods: list[Any] = []
    for a, b in zip(layers, layers[1:], strict=False):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _batches(spec: dict[str, Any], rank: int) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    n = spec["batch"] * (spec["warmup"] + spec["steps"])
    return torch.randn(n, spec["layers"][0], generator=g), torch.randint(0, spec["layers"][-1], (n,), generator=g)


def _train(spec: dict[str, Any], system: str, client: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
    rank, world, batch = spec["rank"], spec["world"], spec["batch"]
    model = make_model(spec["layers"])
    x, y = _batches(spec, rank)
    dp: Any = None
    store: Any = None
    group: Any = None
    if system in ("ddp", "ddp-fp16"):
        net: Any = torch.nn.parallel.DistributedDataParallel(model)
        if system == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif system == "ddp-smb":
        import smb_client.torch  # noqa: F401  (registers the backend)
        os.environ["SMB_CONTROLLER"] = spec["controller"]
        group = dist.new_group(backend="smb")
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    else:
        env = WorkerEnv(rank=rank, world_size=world, local_rank=0, local_world_size=1)
        store = open_store(client, env, f"{spec['tag']}/{system.replace('+', '-')}", model, workers=world,
                           buffers=False, replace=True)
        dp = SyncDataParallel(store, rank, world, overlap=system.startswith("smb+hooks"), publish_every=0,
                              buffers="none", exchange="collective", priority=not system.endswith("-fifo"),
                              compression="bf16" if system.endswith("-bf16") else None)
        net = model
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    times: list[float] = []
    window = [0.0, 0.0]
    comm0 = 0.0
    t0 = 0.0
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            dist.barrier()
            window[0], t0 = time.time(), time.perf_counter()
            comm0 = dp.comm_wait if dp is not None else 0.0
        lo = step * batch
        if dp is not None:
            dp.zero_grad()
        else:
            opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[lo:lo + batch]), y[lo:lo + batch]).backward()
        if dp is not None:
            dp.synchronize()
        opt.step()
        if step >= spec["warmup"]:
            times.append(time.perf_counter())
    seconds = time.perf_counter() - t0
    window[1] = time.time()
    comm = (dp.comm_wait - comm0) if dp is not None else None
    placement: dict[str, int] = {}
    if dp is not None and dp._coll is not None:
        for chunk in dp._coll.chunks:
            placement[chunk.place.server_id] = placement.get(chunk.place.server_id, 0) + chunk.length
    checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))],
                            dtype=torch.float64)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum)
    same = all(abs(float(s) - float(checksum)) <= 1e-6 * max(1.0, abs(float(checksum))) for s in sums)
    if group is not None:
        dist.destroy_process_group(group)
    if dp is not None:
        dp.close(publish=False)
        client.barrier(f"{spec['tag']}/{system}/closed", world, timeout=BARRIER_TIMEOUT)
        if rank == 0:
            store.destroy()
        else:
            store.close()
    return {"seconds": seconds, "steps": spec["steps"], "step_ends": [t - t0 for t in times],
            "comm_wait": comm, "window": window, "same_weights": same, "chunk_bytes_per_server": placement}


def init_gloo(spec: dict[str, Any]) -> None:
    """One torch thread, and this worker's gloo process group (``spec``: master,
    master_port, rank, world), as every worker of the testbed that runs gloo needs."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:{spec['master_port']}",
                            rank=spec["rank"], world_size=spec["world"],
                            timeout=datetime.timedelta(seconds=BARRIER_TIMEOUT))


def training(spec: dict[str, Any]) -> dict[str, Any]:
    """Every system of ``spec["systems"]`` in turn (default :data:`SYSTEMS`)."""
    import torch.distributed as dist

    from smb_client import Client
    init_gloo(spec)
    out: dict[str, Any] = {}
    try:
        with Client(spec["controller"], os.environ.get("SMB_TOKEN", "")) as client:
            for system in spec.get("systems", SYSTEMS):
                out[system] = _train(spec, system, client)
    finally:
        dist.destroy_process_group()
        gc.collect()   # DDP holds the group in a cycle: free gloo's threads before exit
    return out


MODES = {"training": training}
