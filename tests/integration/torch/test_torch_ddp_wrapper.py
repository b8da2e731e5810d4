"""``smb_client.torch.DistributedDataParallel``: SyncDataParallel over a job in DDP's
shape. Under torchrun it trains to the same weights as DDP on gloo, bit for bit (two
workers); a program that ends without ``close()`` still deletes the job's regions at
exit, and one that crashes leaves them to the job's lease (real torchrun processes on
a real local cluster)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from smb_server.testing import wait_until  # noqa: E402

SCRIPT = textwrap.dedent("""
    import gc, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    import smb_client.torch

    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = torch.randn(256, 12), torch.randint(0, 3, (256,))
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24), torch.nn.ReLU(),
                                torch.nn.Linear(24, 3))
    if mode == "gloo":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ddp = smb_client.torch.DistributedDataParallel(model, lease=2.0)
        with open(f"{out}/name", "w") as f:
            f.write(ddp.job.name)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        lo = (step * world + rank) * 16
        optimizer.zero_grad()
        F.cross_entropy(ddp(x[lo:lo + 16]), y[lo:lo + 16]).backward()
        optimizer.step()
    torch.save({k: v for k, v in model.state_dict().items() if "running" not in k and "batches" not in k},
               f"{out}/{mode}-rank{rank}.pt")
    dist.destroy_process_group()
    gc.collect()  # free the group DDP holds in a reference cycle before the interpreter exits
    if mode == "crash" and rank == 0:
        raise RuntimeError("a crash after training")
""")


def torchrun(cluster, tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")   # a rank that dies on a signal prints its threads' stacks
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "0.2", str(script), mode, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)


def test_it_trains_as_ddp_and_its_regions_go_at_exit(cluster, client, tmp_path):
    for mode in ("gloo", "sdp"):
        proc = torchrun(cluster, tmp_path, mode)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "failed" not in proc.stderr, proc.stderr[-4000:]   # nothing went wrong at exit
    for rank in (0, 1):
        want = torch.load(tmp_path / f"gloo-rank{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / f"sdp-rank{rank}.pt", weights_only=True)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), rank
    name = (tmp_path / "name").read_text()
    assert name.startswith("ddp/")
    assert client.list_regions(name + "/") == []        # deleted at exit, without close()


def test_a_crashed_program_leaves_its_regions_to_the_lease(cluster, client, tmp_path):
    proc = torchrun(cluster, tmp_path, "crash")
    assert proc.returncode != 0 and "a crash after training" in proc.stderr
    name = (tmp_path / "name").read_text()
    wait_until(lambda: client.list_regions(name + "/") == [], "the lease to remove the regions", 30, pause=0.2)


def test_a_failed_creation_leaves_nothing_once_its_lease_ran_out(cluster, client, name, monkeypatch):
    """The wrapper's job names are never used again, so its failure record must not
    wait for a next creation: it holds the job's lease, as the store would have."""
    from smb_client.torch import DistributedDataParallel
    from smb_protocol.errors import OutOfMemory

    monkeypatch.setenv("SMB_CONTROLLER", cluster.address)
    monkeypatch.setenv("SMB_TOKEN", cluster.token)
    # 400 gradient slots of 4 MiB: more than the cluster holds
    with pytest.raises(OutOfMemory):
        DistributedDataParallel(torch.nn.Linear(1024, 1024), name=name, lease=1.0,
                                job_options={"grad_slots": 400})
    assert f"{name}/failed" in [r.name for r in client.list_regions(name + "/")]
    wait_until(lambda: client.list_regions(name + "/") == [], "the lease to remove the regions", 30, pause=0.2)


def test_ddps_arguments_are_taken(cluster, client, name, monkeypatch):
    """A DDP call moves over unchanged: the arguments that mean something here are
    used, the others accepted."""
    from smb_client.torch import DistributedDataParallel
    from smb_client.torch.job import Job
    from smb_protocol.errors import InvalidArgument

    monkeypatch.setenv("SMB_CONTROLLER", cluster.address)
    monkeypatch.setenv("SMB_TOKEN", cluster.token)
    asked: dict = {}
    sync = Job.sync

    def spy(self, **options):
        asked.update(options)
        return sync(self, **options)
    monkeypatch.setattr(Job, "sync", spy)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2), "unused": torch.nn.Linear(4, 2)})
    ddp = DistributedDataParallel(model, device_ids=None, output_device=None, broadcast_buffers=False,
                                  bucket_cap_mb=1, find_unused_parameters=True, gradient_as_bucket_view=True,
                                  static_graph=False, name=name, lease=5.0)
    try:
        assert (ddp.dp.buffers, asked["bucket_bytes"]) == ("none", 1 << 20)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        unused = model["unused"].weight.detach().clone()
        for _ in range(2):
            opt.zero_grad()
            model["used"](torch.ones(3, 4)).sum().backward()    # one layer gets no gradient
            opt.step()
        assert ddp.dp.step == 2 and torch.equal(model["unused"].weight, unused)   # a zero gradient
    finally:
        ddp.close()
    assert client.list_regions(name + "/") == []
    with pytest.raises(InvalidArgument, match="mixed_precision"):
        DistributedDataParallel(model, mixed_precision=object(), name=name)


def test_the_wrapper_sends_16_bit_gradients_when_asked(cluster, client, name, monkeypatch):
    """``compression="bf16"`` reaches SyncDataParallel: its rounds push bfloat16, and the
    steps train as DDP's would (one worker: the sum is its own gradient, rounded once
    to bfloat16 on the way back)."""
    from smb_client.torch import DistributedDataParallel
    from smb_protocol.dtypes import bf16_to_f32, f32_to_bf16

    monkeypatch.setenv("SMB_CONTROLLER", cluster.address)
    monkeypatch.setenv("SMB_TOKEN", cluster.token)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    alone = torch.nn.Linear(64, 8)
    alone.load_state_dict(model.state_dict())
    x = torch.randn(5, 64)
    alone(x).square().sum().backward()
    local = alone.weight.grad                           # the gradient before any exchange
    ddp = DistributedDataParallel(model, name=name, lease=5.0, compression="bf16")
    try:
        assert (ddp.dp.wire, ddp.dp.full_sum) == ("bf16", False)
        model(x).square().sum().backward()                 # the round ends in the backward pass
        ddp.dp.synchronize()
        rounded = bf16_to_f32(f32_to_bf16(local.numpy().ravel())).reshape(local.shape)
        assert torch.equal(model.weight.grad, torch.from_numpy(rounded))
        assert not torch.equal(model.weight.grad, local)
    finally:
        ddp.close()
    assert client.list_regions(name + "/") == []


def test_a_restarted_wrapper_starts_afresh_unless_told_to_resume(cluster, client, name, monkeypatch):
    """After a restart the wrapper replaces the dead attempt's store, so a DDP loop that
    begins again at its first step begins from the first weights too, not from the
    store's mid-run ones; ``job_options={"resume": True}`` goes on from the store."""
    from smb_client.torch import DistributedDataParallel, WorkerEnv

    monkeypatch.setenv("SMB_CONTROLLER", cluster.address)
    monkeypatch.setenv("SMB_TOKEN", cluster.token)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)
    first = make()
    ddp = DistributedDataParallel(first, name=name, lease=30.0)
    opt = torch.optim.SGD(first.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()
        opt.step()
    ddp.__exit__(RuntimeError, None, None)               # the worker dies: the store stays

    resumed = make()
    ddp = DistributedDataParallel(resumed, name=name, lease=30.0,
                                  job_options={"env": WorkerEnv(restart_count=1), "resume": True})
    assert ddp.job.resumed == "store"                    # the weights published mid-run
    assert not torch.equal(resumed.weight, make().weight)
    ddp.__exit__(RuntimeError, None, None)

    again = make()                                       # the default: a second restart starts afresh
    ddp = DistributedDataParallel(again, name=name, lease=30.0, job_options={"env": WorkerEnv(restart_count=2)})
    try:
        assert ddp.job.resumed is None and ddp.job.step == 0
        assert torch.equal(again.weight, make().weight)  # the first weights, not the store's
    finally:
        ddp.close()
    assert client.list_regions(name + "/") == []
