"""The ``smb`` torch.distributed backend: collectives and plain DDP through the memory
box (worker processes on a real local cluster)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import threading
import time
import traceback

import numpy as np
import pytest

from smb_server.testing import spawn_ranks
from tests.integration.daemons import free_port

torch = pytest.importorskip("torch")

STEPS = 4
BATCH = 6       # per rank and step
LR = 0.1


def run_processes(cluster, target, world, *args, timeout=120, pg_timeout=60):
    """Run ``target(rank, world, *args)`` in ``world`` processes joined by
    ``init_process_group("smb")``; its results by rank (a worker's failure fails)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    return spawn_ranks(world, _worker, cluster.address, cluster.token, init, target, world, args, pg_timeout,
                       timeout=timeout)


def _worker(rank, queue, address, token, init, target, world, args, pg_timeout):
    try:
        os.environ.update(SMB_CONTROLLER=address, SMB_TOKEN=token)
        import torch.distributed as dist

        import smb_client.torch  # noqa: F401  (registers the backend)
        torch.set_num_threads(1)
        dist.init_process_group("smb", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            out = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def collectives(rank, world):
    import torch.distributed as dist

    from smb_client.torch.backend import SMBWork, UnsupportedOperation
    out = {"backend": dist.get_backend(), "prefix": dist.distributed_c10d._get_default_group().prefix}
    big = torch.arange(100_000, dtype=torch.int64) * (rank + 1) + (1 << 40)   # exact: no float rounding
    dist.all_reduce(big)
    out["int64"] = big.numpy().copy()
    halves = [torch.full((7,), float(rank + 1), dtype=dt) for dt in (torch.float32, torch.bfloat16)]
    works = [dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True) for t in halves]   # queued in order
    assert all(isinstance(w, SMBWork) for w in works)
    [w.wait() for w in works]
    out["avg"] = [t.float().numpy().copy() for t in halves]
    fut = dist.all_reduce(torch.ones(3, dtype=torch.int32), async_op=True).get_future()
    out["future"] = fut.wait()[0].numpy().copy()
    strided = torch.zeros(4, 6, dtype=torch.float64)[:, ::2]          # not contiguous
    strided += rank
    dist.all_reduce(strided)
    out["strided"] = strided.numpy().copy()
    b = torch.full((5,), rank, dtype=torch.float32)
    flags = torch.tensor([rank == 1, rank != 1, True])                 # bool: moved as bytes
    dist.broadcast(b, src=1)
    dist.broadcast(flags, src=1)
    out["broadcast"] = (b.numpy().copy(), flags.numpy().copy())
    gathered = [torch.empty(3, dtype=torch.float16) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), rank - 0.5, dtype=torch.float16))
    out["all_gather"] = [g.float().numpy().copy() for g in gathered]
    into = torch.empty(world * 2, dtype=torch.int64)
    dist.all_gather_into_tensor(into, torch.tensor([rank, -rank]))
    out["into"] = into.numpy().copy()
    shard = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(shard, torch.arange(world * 2, dtype=torch.int64) + rank)
    out["reduce_scatter"] = shard.numpy().copy()
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        try:
            dist.all_reduce(torch.ones(2), op=op)
        except UnsupportedOperation as exc:
            out.setdefault("unsupported", []).append(str(exc))
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
    except UnsupportedOperation as exc:
        out["int_avg"] = str(exc)
    pair = dist.new_group([0, 2])                                       # a group of its own
    if rank in (0, 2):
        mine = torch.tensor([rank + 1.0])
        dist.all_reduce(mine, group=pair)
        out["pair"] = mine.item()
        dist.destroy_process_group(pair)                               # a group alone goes too
    try:
        dist.reduce(torch.ones(2), dst=0)
    except UnsupportedOperation as exc:
        out["reduce"] = str(exc)
    dist.barrier()
    return out


def test_collectives(cluster):
    world = 3
    results = run_processes(cluster, collectives, world)
    with cluster.client() as client:     # destroy_process_group deleted the collectives
        assert client.list_regions(results[0]["prefix"] + "/") == []
    want = sum(np.arange(100_000, dtype=np.int64) * (r + 1) + (1 << 40) for r in range(world))
    for out in results:
        assert out["backend"] == "smb"
        assert out["int64"].dtype == np.int64 and np.array_equal(out["int64"], want)
        for avg in out["avg"]:
            np.testing.assert_array_equal(avg, np.full(7, 2.0))     # (1 + 2 + 3) / 3
        np.testing.assert_array_equal(out["future"], [3, 3, 3])
        np.testing.assert_array_equal(out["strided"], np.full((4, 3), 3.0))
        np.testing.assert_array_equal(out["broadcast"][0], np.ones(5))
        np.testing.assert_array_equal(out["broadcast"][1], [True, False, True])
        for r, g in enumerate(out["all_gather"]):
            np.testing.assert_array_equal(g, np.full(3, r - 0.5))
        np.testing.assert_array_equal(out["into"], [0, 0, 1, -1, 2, -2])
        assert len(out["unsupported"]) == 2
        assert "MAX" in out["unsupported"][0] and "SUM and AVG" in out["unsupported"][0]
        assert "PRODUCT" in out["unsupported"][1]
        assert "int64" in out["int_avg"] and "float32" in out["int_avg"]
        assert "no reduce" in out["reduce"]
        assert out.get("pair") == (4.0 if out is not results[1] else None)
    for rank, out in enumerate(results):
        full = sum(np.arange(world * 2) + r for r in range(world))
        np.testing.assert_array_equal(out["reduce_scatter"], full[2 * rank:2 * rank + 2])


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.BatchNorm1d(64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def train_ddp(rank, world, group, hook=None, bucket_cap_mb=0.001):
    """A few DDP steps; each rank starts from its own seed (DDP broadcasts rank 0's).
    ``hook``: ``"fp16"`` (DDP's fp16_compress_hook) or ``"powersgd"`` (its PowerSGD hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = make_model(100 + rank)
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb)   # default: several buckets, overlapped
    if hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=0.5)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, world, BATCH, 10, generator=g)
    y = torch.randint(0, 4, (STEPS, world, BATCH), generator=g)
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[step, rank]), y[step, rank]).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def ddp_both(rank, world, hook=None):
    import torch.distributed as dist
    # PowerSGD's hook waits for an all-reduce inside a callback; with many small buckets the
    # gloo group hung here (test_powersgd_with_many_buckets_... runs those on smb): one bucket
    cap = 25 if hook == "powersgd" else 0.001
    smb = train_ddp(rank, world, None, hook, cap)                    # the default group: smb
    gloo = train_ddp(rank, world, dist.new_group(backend="gloo"), hook, cap)
    return smb, gloo


@pytest.mark.parametrize("hook", [None, "fp16", "powersgd"])
def test_ddp_on_smb_equals_ddp_on_gloo(cluster, hook):
    """Two ranks: a sum of two numbers has one order, so the weights agree bit for bit;
    the same with DDP's own communication hooks (fp16 compression, PowerSGD) registered
    unchanged on the smb process group."""
    results = run_processes(cluster, ddp_both, 2, hook)
    start = make_model(100).state_dict()
    for smb, gloo in results:
        assert smb.keys() == gloo.keys()
        for key in smb:
            assert np.array_equal(smb[key], gloo[key]), key
        for key in smb:     # replicas equal (a rank's last forward moved its own statistics, as with gloo)
            assert "running" in key or np.array_equal(smb[key], results[0][0][key]), key
        assert np.abs(smb["0.weight"] - start["0.weight"].numpy()).max() > 1e-3
        assert smb["1.num_batches_tracked"] == STEPS


def test_powersgd_with_many_buckets_keeps_every_rank_in_step(cluster):
    """PowerSGD chains all-reduces in callbacks of earlier ones, bucket after bucket; the
    smb group runs every callback in the order it was chained, so both ranks start the
    same all-reduces in the same order and end with the same weights."""
    results = run_processes(cluster, train_ddp, 2, None, "powersgd", 0.001)
    start = make_model(100).state_dict()
    for key in results[0]:
        assert "running" in key or np.array_equal(results[0][key], results[1][key]), key
    assert np.abs(results[0]["0.weight"] - start["0.weight"].numpy()).max() > 1e-3


def until_failure(rank, world, ready):
    import torch.distributed as dist
    t = torch.ones(256 << 10)                       # 1 MiB: chunks on both servers
    for _ in range(3):
        dist.all_reduce(t)
    start = time.monotonic()
    while time.monotonic() - start < 60:
        work = dist.all_reduce(t, async_op=True)
        if ready is not None:
            ready.put(rank)                         # an operation is on its way: kill now
            ready = None
        try:
            work.wait()
        except Exception as exc:
            failed = (type(exc).__name__, str(exc), time.monotonic() - start)
            break
    else:
        return None
    try:
        dist.all_reduce(torch.ones(4))
        refused = None
    except Exception as exc:
        refused = str(exc)
    return failed, refused


def test_a_dead_server_fails_wait_not_hangs(fresh_cluster):
    from smb_protocol import errors
    ready = mp.get_context("spawn").Queue()
    out = {}

    def kill_when_ready():
        for _ in range(2):
            ready.get(timeout=60)
        fresh_cluster.kill_server(0)
    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    try:
        out["results"] = run_processes(fresh_cluster, until_failure, 2, ready, pg_timeout=30)
    finally:
        killer.join(70)
    for result in out["results"]:
        assert result is not None, "no operation failed after the server died"
        (kind, message, seconds), refused = result
        assert seconds < 20, (kind, message, seconds)
        assert issubclass(getattr(errors, kind), errors.SMBError), (kind, message)
        assert refused is not None and "failed earlier" in refused
