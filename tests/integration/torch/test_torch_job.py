"""``smb_client.torch.job``: a job creates or attaches its store, resumes every worker
from a checkpoint file (weights, optimizer state, step), deletes its regions when all
workers finished, leaves them to its lease after a failure, keeps them across a
``torchrun --max-restarts`` restart and loses them once it crashed for good (worker
threads and torchrun processes on a real local cluster)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import Job, ParameterStore, WorkerEnv, job  # noqa: E402
from smb_protocol.errors import InvalidArgument  # noqa: E402
from smb_server.testing import run_ranks, wait_until  # noqa: E402
from tests.integration.torch.training import local_step, rank_batch  # noqa: E402

WORLD = 2
BATCH = 8
LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def data(steps: int):
    g = torch.Generator().manual_seed(5)
    n = steps * WORLD * BATCH
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def run_workers(cluster, name, steps, checkpoint=None, save=False):
    """Train ``steps`` steps (from the job's step on) in WORLD threads; per rank: the
    job's resumed and step, the final weights and the optimizer's momentum."""
    x, y = data(8)
    models = [make_model() for _ in range(WORLD)]

    def worker(rank: int) -> tuple:
        with cluster.client() as c:
            model = models[rank]
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
            with job(name, model, checkpoint=checkpoint, optimizer=opt, client=c,
                     env=WorkerEnv(rank, WORLD)) as j:
                j.sync()
                started = (j.resumed, j.step)
                for step in range(j.step, steps):
                    local_step(model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
                if save:
                    j.save(step=steps)
            momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            return started, {k: v.clone() for k, v in model.state_dict().items()}, momentum

    return run_ranks(WORLD, worker)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_worker_resumes_from_a_checkpoint_as_if_never_stopped(cluster, client, name, tmp_path):
    path = tmp_path / "job.pt"
    whole = run_workers(cluster, f"{name}-whole", 5)
    first = run_workers(cluster, name, 3, checkpoint=path, save=True)
    assert client.list_regions(f"{name}/") == []            # the finished job cleaned up
    assert [r[0] for r in first] == [(None, 0)] * WORLD       # a fresh start: no file yet
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 3 and saved["optimizer"]["state"] and same(saved["model"], first[0][1])
    second = run_workers(cluster, name, 5, checkpoint=path)
    assert client.list_regions(f"{name}/") == []
    for rank in range(WORLD):
        started, state, momentum = second[rank]
        assert started == ("checkpoint", 3)
        assert same(state, whole[rank][1]), f"rank {rank} differs from the uninterrupted run"
        assert all(torch.equal(a, b) for a, b in zip(momentum, whole[rank][2], strict=True))


def test_seasgd_workers_save_and_resume_the_global_weights(cluster, client, name, tmp_path):
    path = tmp_path / "seasgd.pt"
    x, y = data(4)
    models: list[torch.nn.Module] = []

    def worker(rank: int) -> dict:
        model = models[rank]
        with cluster.client() as c:
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            with job(name, model, checkpoint=path, optimizer=opt, client=c, env=WorkerEnv(rank, WORLD),
                     scheme="seasgd") as j:
                start = {"resumed": j.resumed, "step": j.step,
                         "state": {k: v.clone() for k, v in model.state_dict().items()}}
                c.barrier(f"{name}/started", WORLD)   # nobody pushes before everybody attached
                w = j.seasgd(update_interval=1)
                for step in range(4):
                    local_step(model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
                    w.after_step()
                w.finish()                            # every delta in the global weights
                c.barrier(f"{name}/trained", WORLD)   # both finished: the store is final
                j.save(step=4)
        return start

    starts = []
    for run in range(2):
        models[:] = [make_model() for _ in range(WORLD)]   # here: the global RNG is not the threads' to share
        starts.append(run_ranks(WORLD, worker))
        assert client.list_regions(f"{name}/") == []
        if run == 0:
            saved = torch.load(path, weights_only=True)
    assert [starts[0][r]["resumed"] for r in range(WORLD)] == [None, None]
    for rank in range(WORLD):
        again = starts[1][rank]
        assert again["resumed"] == "checkpoint" and again["step"] == 4
        params = {k: v for k, v in saved["model"].items() if "running" not in k and "batches" not in k}
        assert all(torch.equal(again["state"][k], v) for k, v in params.items()), rank   # the global weights


def test_a_failed_job_leaves_its_regions_to_the_lease(cluster, name):
    out: list[BaseException | None] = [None]
    model = make_model()
    with cluster.client() as c:
        try:
            with job(name, model, client=c, lease=1.0):
                raise RuntimeError("training failed")
        except RuntimeError as exc:
            out[0] = exc
        assert str(out[0]) == "training failed"
        assert c.list_regions(f"{name}/")                     # still there: a restart would attach
    with cluster.client() as c:                               # its lease is no longer renewed
        wait_until(lambda: c.list_regions(f"{name}/") == [], "the lease to remove the regions", 30, pause=0.2)


@pytest.mark.parametrize("scheme", [None, "seasgd"])
def test_seasgd_trains_with_the_job_defaults_and_keeps_deltas_with_its_scheme(cluster, client, name, scheme):
    """``job()`` then ``j.seasgd()`` works as written; ``scheme="seasgd"`` reserves every
    worker's delta slot, which the worker then fills."""
    x, y = data(4)

    def worker(rank: int) -> tuple[int, bool, float]:
        with cluster.client() as c:
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            with job(name, model, client=c, env=WorkerEnv(rank, WORLD), scheme=scheme) as j:
                w = j.seasgd(update_interval=1)
                for step in range(2):
                    local_step(model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
                    w.after_step()
                w.finish()
                kept = 0.0
                if j.store.delta_slots:
                    delta = j.store.flat.new_flat()
                    j.store.read_into("deltas", j.store.slot_offset("deltas", rank), delta)
                    kept = float(delta.abs().sum())
                return j.store.delta_slots, w.keep_deltas, kept

    seen = run_ranks(WORLD, worker)
    for rank in range(WORLD):
        slots, keeps, kept = seen[rank]
        assert (slots, keeps) == ((WORLD, True) if scheme else (0, False))
        assert (kept > 0) == bool(scheme)
    assert client.list_regions(f"{name}/") == []


def test_job_misuse_says_what_to_do(cluster, name, tmp_path):
    model = make_model()
    with pytest.raises(TypeError, match="workers"):
        Job(name, model, workers=3)                         # the job sets it: not an option
    with pytest.raises(InvalidArgument, match="seasgd"):
        Job(name, model, scheme="elastic")
    j = Job(name, model)
    with pytest.raises(InvalidArgument, match="has not started"):
        j.store.close()
    with cluster.client() as c, job(name, model, client=c) as j:
        with pytest.raises(InvalidArgument, match="needs a path"):
            j.save()
        j.save(tmp_path / "x.pt")                           # nothing trained: the store's weights
    assert same(torch.load(tmp_path / "x.pt", weights_only=True), model.state_dict())


def test_store_checkpoints_carry_the_optimizer(cluster, client, name, tmp_path):
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    store = ParameterStore.create(client, name, model)
    try:
        store.save(tmp_path / "plain.pt")
        store.save(tmp_path / "full.pt", opt, step=7)
        other = torch.optim.Adam(model.parameters())
        assert store.load(tmp_path / "full.pt", other) == {"step": 7}
        assert other.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
        assert store.load(tmp_path / "plain.pt") == {}
        with pytest.raises(InvalidArgument, match="holds no optimizer state"):
            store.load(tmp_path / "plain.pt", other)
    finally:
        store.destroy()


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import torch, torch.nn.functional as F
    import smb_client.torch as smb

    name, out, steps, lease = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with smb.job(name, model, lease=lease) as j:
        dp = j.sync()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            lo = (step * j.world + j.rank) * 8
            opt.zero_grad()
            F.cross_entropy(model(x[lo:lo + 8]), y[lo:lo + 8]).backward()
            opt.step()
            if step == 1 and j.rank == 1 and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)          # a crash in the first attempt
        with open(f"{out}/rank{j.rank}.json", "w") as f:
            json.dump({"resumed": j.resumed, "restart": restart, "owner": j.owner}, f)
""")


def torchrun(cluster, tmp_path, name, restarts, lease):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "--max-restarts", str(restarts), "--monitor-interval", "0.2", str(script), name, str(out), "4",
           str(lease)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return proc, out


@pytest.mark.timeout(400)
def test_the_lease_survives_a_torchrun_restart_and_the_job_cleans_up(cluster, client, name, tmp_path):
    proc, out = torchrun(cluster, tmp_path, name, restarts=1, lease=30.0)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in reports:
        assert r["restart"] == 1 and r["resumed"] == "store", r     # the first attempt's store, kept
    assert reports[0]["owner"] == reports[1]["owner"]
    assert client.list_regions(f"{name}/") == []


@pytest.mark.timeout(400)
def test_a_job_that_crashed_for_good_leaves_nothing(cluster, client, name, tmp_path):
    proc, _ = torchrun(cluster, tmp_path, name, restarts=0, lease=2.0)
    assert proc.returncode != 0
    wait_until(lambda: client.list_regions(f"{name}/") == [], "the lease to remove the regions", 60, pause=0.2)
