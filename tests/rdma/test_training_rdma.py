"""Synchronous training whose gradients go over RDMA (Soft-RoCE, real verbs): the digits
model (64 inputs, 10 classes) trained through ``SyncDataParallel`` by two worker
processes whose regions open over rdma ends with exactly the weights of the same
training with the exchange forced onto tcp (``SMB_EXCHANGE_TRANSPORT=tcp``), run next by
the same processes. Two parties' float sums do not depend on the order their pushes
arrive in, so the weights must be equal bit for bit.

Only the ranks import torch: under the VM's emulated CPUs one import of torch takes about
two minutes, and the test process has no use for it. The samples are random (seeded, the
same in both ranks) rather than the digits, whose loader would import scikit-learn (as
long again): the check is the equality of the two runs, not what the model learns."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from smb_server.testing import spawn_ranks

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)

WORLD = 2
BATCH = 16
STEPS = 5


def _samples() -> tuple[np.ndarray, np.ndarray]:
    """Enough samples for STEPS steps of WORLD ranks: features in [0, 1), labels 0-9."""
    rng = np.random.default_rng(0)
    n = STEPS * WORLD * BATCH
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n)


def _train(client, prefix: str, rank: int, x, y) -> tuple[np.ndarray, bool]:
    """Train STEPS steps; (the final weights, whether every chunk went by rdma)."""
    import torch

    from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
    from smb_client.transports.rdma.reduce import RdmaReduceStream
    from smb_train.workers import make_model
    from tests.integration.torch.training import rank_batch, sync_step
    env = WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
    model = make_model(7, 64)
    store = open_store(client, env, prefix, model, workers=WORLD)
    dp = SyncDataParallel(store, rank, WORLD, bucket_bytes=8192)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        sync_step(dp, model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
    coll = dp.collective
    over_rdma = coll is not None and all(
        isinstance(coll.region.route.stream(c.slot, coll.transport == "auto")[0], RdmaReduceStream)
        for c in coll.chunks)
    dp.close()
    client.barrier(f"{prefix}/end", WORLD, timeout=120)
    weights = store.flat.flat_params.numpy().copy()
    if rank == 0:
        store.destroy()
    else:
        store.close()
    return weights, over_rdma


def worker(rank: int, queue, address: str, token: str, prefix: str) -> None:
    try:
        import torch

        import smb_client
        torch.set_num_threads(1)
        x, y = (torch.from_numpy(a) for a in _samples())
        with smb_client.connect(address, token, transport="rdma") as client:
            got = [_train(client, f"{prefix}-rdma", rank, x, y)]
            os.environ["SMB_EXCHANGE_TRANSPORT"] = "tcp"
            got.append(_train(client, f"{prefix}-tcp", rank, x, y))
        queue.put((rank, got))
    except BaseException as exc:
        queue.put((rank, repr(exc)))
        raise


@pytest.mark.timeout(900)   # the VM emulates its CPUs: each rank's import of torch takes minutes
def test_sync_training_over_rdma_equals_the_tcp_run(cluster, name):
    results = spawn_ranks(WORLD, worker, cluster.address, cluster.token, name, timeout=800)
    (rdma0, on_rdma0), (tcp0, on_rdma_tcp0) = results[0]
    (rdma1, on_rdma1), (tcp1, _) = results[1]
    assert on_rdma0 and on_rdma1 and not on_rdma_tcp0
    np.testing.assert_array_equal(rdma0, rdma1)
    np.testing.assert_array_equal(tcp0, tcp1)
    np.testing.assert_array_equal(rdma0, tcp0)
