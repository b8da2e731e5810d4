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
import time

import pytest

torch = pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import sys
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
    if mode == "crash" and rank == 0:
        raise RuntimeError("a crash after training")
""")


def torchrun(cluster, tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, OMP_NUM_THREADS="1")
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
    deadline = time.monotonic() + 30
    while client.list_regions(name + "/") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.list_regions(name + "/") == []
