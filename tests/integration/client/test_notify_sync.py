"""Synchronous training meets on the memory box's barrier: over 100 steady-state steps
the workers make no controller call (counted by the controller's own /metrics)."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from tests.integration.daemons import scrape, start_server

torch = pytest.importorskip("torch")

WORLD = 2
STEPS = 100
WARMUP = 2          # steps before counting: the first one meets at the controller's barrier
SERVER_METHODS = {"RegisterServer", "Heartbeat", "UnregisterServer"}   # the memory server's own calls


def worker(address, token, transport, prefix, rank, queue, go, finish):
    try:
        import smb_client
        from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        env = WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
        g = torch.Generator().manual_seed(rank)
        with smb_client.connect(address, token, transport=transport) as client:
            store = open_store(client, env, prefix, model, grad_slots=3, workers=WORLD)
            dp = SyncDataParallel(store, rank, WORLD, overlap=False, publish_every=0, barrier_timeout=120)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)

            def step() -> None:
                dp.zero_grad()
                x = torch.randn(4, 8, generator=g)
                model(x).square().mean().backward()
                dp.synchronize()
                opt.step()
            for _ in range(WARMUP):
                step()
            queue.put(("ready", rank, None))
            assert go.wait(120)
            for _ in range(STEPS):
                step()
            queue.put(("done", rank, store.flat.flat_params.numpy().copy()))
            assert finish.wait(120)
            dp.close(publish=False)
            if rank == 0:
                store.destroy()
            else:
                store.close()
    except BaseException as exc:
        queue.put(("error", rank, repr(exc)))
        raise


def controller_calls(port: int) -> dict[str, float]:
    """Calls served by the controller so far, by method (the memory servers' own excluded)."""
    return {dict(labels)["method"]: value for (metric, labels), value in scrape(port).items()
            if metric == "smb_controller_rpc_seconds_count" and dict(labels)["method"] not in SERVER_METHODS}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_steady_state_sync_steps_make_no_controller_call(tmp_path, cluster_env, transport):
    env, daemons, ctl_metrics = cluster_env
    start_server(tmp_path, env, daemons, "s0", "--capacity", "64M", "--transports", "tcp,shm").wait_ready()
    ctx = mp.get_context("spawn")
    queue, go, finish = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport,
                                              f"sync/{transport}", r, queue, go, finish)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        def collect(kind: str) -> list:
            got = [queue.get(timeout=240) for _ in procs]
            assert all(k == kind for k, _, _ in got), got
            return got
        collect("ready")
        before = controller_calls(ctl_metrics)
        go.set()
        done = collect("done")
        after = controller_calls(ctl_metrics)
        finish.set()
    finally:
        go.set()
        finish.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert np.array_equal(done[0][2], done[1][2])            # the replicas stayed in step
    grown = {m: after.get(m, 0) - before.get(m, 0) for m in after}
    assert not any(grown.values()), grown
    # store ready + the first step, per worker: at least one call each; a rank that waits
    # longer than REPORT_EVERY for a late one (a slow start) calls again for the next slice
    assert after["Barrier"] >= 2 * WORLD
