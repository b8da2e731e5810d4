"""Synchronous training whose gradients go over RDMA (Soft-RoCE, real verbs): the digits
model trained through ``SyncDataParallel`` by two worker processes whose regions open
over rdma ends with exactly the weights of the same run with the exchange forced onto
tcp (``SMB_EXCHANGE_TRANSPORT=tcp``). Two parties' float sums do not depend on the
order their pushes arrive in, so the weights must be equal bit for bit."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

WORLD = 2
BATCH = 16
STEPS = 5


def worker(address: str, token: str, prefix: str, rank: int, exchange: str, queue) -> None:
    try:
        if exchange == "tcp":
            os.environ["SMB_EXCHANGE_TRANSPORT"] = "tcp"
        import smb_client
        from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
        from smb_client.transports.rdma.reduce import RdmaReduceStream
        from smb_train.workers import load_data, make_model
        torch.set_num_threads(1)
        data = load_data()
        x, y = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
        env = WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
        with smb_client.connect(address, token, transport="rdma") as client:
            model = make_model(7, 64)
            store = open_store(client, env, prefix, model, workers=WORLD)
            dp = SyncDataParallel(store, rank, WORLD, bucket_bytes=8192)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(STEPS):
                lo = (step * WORLD + rank) * BATCH
                dp.zero_grad()
                torch.nn.functional.cross_entropy(model(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
                dp.synchronize()
                opt.step()
            coll = dp.collective
            over_rdma = coll is not None and all(
                isinstance(coll.region.route.stream(c.slot, coll.transport == "auto")[0], RdmaReduceStream)
                for c in coll.chunks)
            dp.close()
            client.barrier(f"{prefix}/end", WORLD, timeout=120)
            queue.put((rank, store.flat.flat_params.numpy().copy(), over_rdma))
            if rank == 0:
                store.destroy()
            else:
                store.close()
    except BaseException as exc:
        queue.put((rank, repr(exc), None))
        raise


def train(cluster, name: str, exchange: str) -> list[tuple[int, np.ndarray, bool]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(cluster.address, cluster.token, f"{name}-{exchange}", r, exchange,
                                               queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank, params, _ in got:
        assert isinstance(params, np.ndarray), (rank, params)
    return got


def test_sync_training_over_rdma_equals_the_tcp_run(cluster, name):
    over_rdma = train(cluster, name, "auto")
    over_tcp = train(cluster, name, "tcp")
    assert [r[2] for r in over_rdma] == [True, True]
    assert [r[2] for r in over_tcp] == [False, False]
    np.testing.assert_array_equal(over_rdma[0][1], over_rdma[1][1])
    np.testing.assert_array_equal(over_rdma[0][1], over_tcp[0][1])
