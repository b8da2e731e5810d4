"""Frozen parameters (requires_grad=False) under synchronous training: untouched, no
.grad, no traffic; the trainable ones equal one process on the union of the batches
(worker threads with their own clients on a real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import FlatModel, ParameterStore, SyncDataParallel  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.training import train_on_the_union  # noqa: E402

WORLD = 2
BATCH = 8
STEPS = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model[2].requires_grad_(False)          # a frozen layer between two trainable ones
    model[0].bias.requires_grad_(False)
    return model


def data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(STEPS * WORLD * BATCH, 6, generator=g), torch.randint(0, 3, (STEPS * WORLD * BATCH,),
                                                                             generator=g)


def optimizer(model):
    # over all parameters, with weight decay: a zero .grad on a frozen weight would move it
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


@pytest.mark.parametrize("exchange", ["collective", "slots"])
@pytest.mark.parametrize("overlap", [True, False])
def test_frozen_parameters_stay_untouched_and_cost_no_traffic(cluster, name, overlap, exchange):
    x, y = data()
    models = [make_model() for _ in range(WORLD)]
    frozen = {n: p.detach().clone() for n, p in models[0].named_parameters() if not p.requires_grad}
    assert set(frozen) == {"0.bias", "2.weight", "2.bias"}
    master_client = cluster.client()
    store0 = ParameterStore.create(master_client, name, models[0], grad_slots=3, workers=WORLD)
    try:
        def worker(rank):
            with cluster.client() as client:
                return train(rank, client)

        def train(rank, client):
            model = models[rank]
            store = store0 if rank == 0 else ParameterStore.attach(client, name, model)
            dp = SyncDataParallel(store, rank, WORLD, overlap=overlap, bucket_bytes=256, publish_every=0,
                                  exchange=exchange)
            opt = optimizer(model)
            before = store.traffic.as_dict()
            for step in range(STEPS):
                lo = (step * WORLD + rank) * BATCH
                dp.zero_grad()
                torch.nn.functional.cross_entropy(model(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
                dp.synchronize()
                for n, p in model.named_parameters():
                    assert (p.grad is None) == (n in frozen), n
                opt.step()
            dp.close(publish=False)
            after = store.traffic.as_dict()
            if rank:
                store.close()
            return {k: after[k] - before[k] for k in after}, store.flat.flat_params.clone()

        results = run_ranks(WORLD, worker)
        runs = FlatModel(make_model()).runs()
        trainable_bytes = sum(n for _, n in runs)
        slot = store0.layout.slot_bytes
        assert trainable_bytes < slot - 16 * 16 * 4      # the frozen 16x16 weight is not covered
        # per step: every worker pushes and pulls the trainable bytes once; with slots, the
        # zeroing of the next slot, split over the workers, covers them once more
        zeroing = 1 if exchange == "slots" else 0
        assert sum(r[0]["sent"] for r in results) == STEPS * (WORLD + zeroing) * trainable_bytes
        assert all(r[0]["received"] == STEPS * trainable_bytes for r in results)

        ref = make_model()
        train_on_the_union(ref, optimizer(ref), x, y, STEPS, WORLD * BATCH)
        for rank, model in enumerate(models):
            assert torch.equal(results[rank][1], results[0][1])
            for n, p in model.named_parameters():
                if n in frozen:
                    assert torch.equal(p, frozen[n]), n
                    assert p.grad is None
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    finally:
        store0.destroy()
        master_client.close()


def test_changing_requires_grad_after_binding_is_an_error(cluster, name):
    from smb_protocol.errors import InvalidArgument
    model = make_model()
    with cluster.client() as c:
        store = ParameterStore.create(c, name, model, grad_slots=3)
        dp = SyncDataParallel(store, 0, 1)
        try:
            model[2].weight.requires_grad_(True)
            dp.zero_grad()
            with pytest.raises(InvalidArgument, match="requires_grad"):
                model(torch.randn(2, 6)).sum().backward()    # it ends by synchronizing
            with pytest.raises(InvalidArgument, match="requires_grad"):
                dp.synchronize()
        finally:
            dp.close(publish=False)
            store.destroy()
