"""Gradient accumulation over micro-batches with SyncDataParallel.no_sync(): k-1
backward passes inside, the last outside, equal one process on the union of every
worker's micro-batches (worker threads on a real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_protocol.errors import InvalidArgument  # noqa: E402
from tests.integration.torch.ranks import run_on_one_store  # noqa: E402
from tests.integration.torch.training import train_on_the_union  # noqa: E402

WORLD = 2
MICRO = 3       # micro-batches per step
BATCH = 4       # samples per micro-batch
STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(21)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 4))


def data():
    g = torch.Generator().manual_seed(5)
    n = STEPS * WORLD * MICRO * BATCH
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y) / MICRO


@pytest.mark.parametrize("overlap", [True, False])
def test_accumulation_under_no_sync_equals_union_of_micro_batches(cluster, name, overlap):
    x, y = data()
    models = [make_model() for _ in range(WORLD)]

    def worker(rank, c, store):
        model = models[rank]
        dp = SyncDataParallel(store, rank, WORLD, overlap=overlap, bucket_bytes=512)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
        for step in range(STEPS):
            def micro(j, step=step):
                lo = ((step * WORLD + rank) * MICRO + j) * BATCH
                loss_fn(model(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
            opt.zero_grad()        # set_to_none: the hooks bring .grad back
            with dp.no_sync():
                for j in range(MICRO - 1):
                    micro(j)
            micro(MICRO - 1)
            dp.synchronize()
            opt.step()
        dp.close()

    run_on_one_store(cluster, name, models, worker, grad_slots=3, workers=WORLD)
    ref = make_model()
    train_on_the_union(ref, torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.5), x, y, STEPS,
                       WORLD * MICRO * BATCH)
    start = make_model()
    for model in models:
        for p, q, s in zip(model.parameters(), ref.parameters(), start.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert not torch.equal(p, s)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_every_backward_outside_no_sync_synchronizes(client, name):
    """As with DDP: each backward pass outside no_sync() is a synchronized step (it used
    to be an error without synchronize() between them); synchronize() inside no_sync()
    is an error."""
    model = make_model()
    store = ParameterStore.create(client, name, model, grad_slots=3)
    dp = SyncDataParallel(store, 0, 1)
    try:
        dp.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        assert dp.step == 1
        model(torch.randn(2, 8)).sum().backward()
        assert dp.step == 2
        dp.synchronize()                              # the backward pass already did
        assert dp.step == 2
        dp.zero_grad()
        with dp.no_sync():
            model(torch.randn(2, 8)).sum().backward()
            with pytest.raises(InvalidArgument, match="no_sync"):
                dp.synchronize()
    finally:
        dp.close(publish=False)
        store.destroy()
