"""The DDP loop, unchanged, with SyncDataParallel: ``optimizer.zero_grad();
loss.backward(); optimizer.step()`` equals one process on the union of the workers'
batches (worker threads with their own clients on a real local cluster)."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import SyncDataParallel  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import rank_store, release  # noqa: E402
from tests.integration.torch.training import train_on_the_union  # noqa: E402

WORLD = 2
BATCH = 8       # per worker and step
STEPS = 5
LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def make_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS * WORLD * BATCH, 10, generator=g), torch.randint(0, 4, (STEPS * WORLD * BATCH,),
                                                                             generator=g)


def reference() -> torch.nn.Module:
    model = make_model()
    x, y = make_data()
    train_on_the_union(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), x, y, STEPS, WORLD * BATCH)
    return model


def train(cluster, name, loop, exchange):
    ready = threading.Event()
    models = [make_model() for _ in range(WORLD)]   # here: the global RNG is not the threads' to share

    def worker(rank: int) -> torch.Tensor:
        try:
            with cluster.client() as c:
                model = models[rank]
                slots = {"grad_slots": 3} if exchange == "slots" else {}
                store = rank_store(c, rank, name, model, ready, workers=WORLD, **slots)
                dp = SyncDataParallel(store, rank, WORLD, bucket_bytes=256, exchange=exchange)
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
                x, y = make_data()
                for step in range(STEPS):
                    lo = (step * WORLD + rank) * BATCH
                    opt.zero_grad()                          # the DDP habit (set_to_none)
                    loss = torch.nn.functional.cross_entropy(model(x[lo:lo + BATCH]), y[lo:lo + BATCH])
                    loss.backward()
                    if loop == "explicit":
                        dp.synchronize()                     # returns at once: backward synchronized
                    opt.step()
                assert dp.step == STEPS
                dp.close()
                c.barrier(f"{name}/end", WORLD, timeout=60)
                result = store.flat.flat_params.clone()
                release(store, rank)
                return result
        finally:
            ready.set()              # a rank 0 that failed keeps nobody waiting

    return run_ranks(WORLD, worker, timeout=90)


@pytest.mark.parametrize("loop,exchange", [("ddp", "auto"), ("explicit", "auto"), ("ddp", "slots")])
def test_the_ddp_loop_equals_one_process_on_the_union(cluster, name, loop, exchange):
    from smb_client.torch import FlatModel
    res = train(cluster, name, loop, exchange)
    ref = FlatModel(reference()).flat_params
    start = FlatModel(make_model()).flat_params
    assert torch.equal(res[0], res[1])                               # the replicas stay equal
    torch.testing.assert_close(res[0], ref, rtol=1e-5, atol=1e-6)
    assert (ref - start).abs().max() > 1e-3                          # training moved the weights
