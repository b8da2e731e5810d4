"""SEASGD and hybrid publish batch-norm statistics with the global weights, so that
``store.load_into`` and ``store.save`` give a model that scores like a worker's replica
(an MLP with BatchNorm1d on scikit-learn's digits, on a real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("sklearn.datasets")

import torch.nn.functional as F  # noqa: E402

from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, ParameterStore  # noqa: E402

BATCH = 32
EPOCHS = 3


def bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def digits():
    """Raw pixel values (0..16, not normalized: batch norm's statistics matter)."""
    d = datasets.load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32), torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_seasgd_global_model_scores_like_a_replica(client, name, tmp_path):
    (x, y), (xt, yt) = digits()
    world = 2
    models = [bn_mlp() for _ in range(world)]
    store0 = ParameterStore.create(client, name, models[0], scheme="seasgd", workers=world)
    stores = [store0, ParameterStore.attach(client, name, models[1])]
    try:
        workers = [SEASGD(s, r, world, update_interval=4) for r, s in enumerate(stores)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        shard = len(y) // world
        for _ in range(EPOCHS):   # the workers take turns, one step each
            for lo in range(0, shard - BATCH + 1, BATCH):
                for r, (m, opt, ea) in enumerate(zip(models, opts, workers, strict=True)):
                    xb, yb = x[r * shard + lo:r * shard + lo + BATCH], y[r * shard + lo:r * shard + lo + BATCH]
                    opt.zero_grad()
                    F.cross_entropy(m(xb), yb).backward()
                    opt.step()
                    ea.after_step()
        for ea in workers:
            ea.close()
        replica = accuracy(models[0], xt, yt)
        evaluator = bn_mlp()
        store0.load_into(evaluator)
        assert torch.equal(evaluator[1].running_mean, models[0][1].running_mean)   # rank 0's
        assert not torch.equal(evaluator[1].running_var, torch.ones(64))
        global_acc = accuracy(evaluator, xt, yt)
        path = tmp_path / "global.pt"
        store0.save(path)
        saved = bn_mlp()
        saved.load_state_dict(torch.load(path, weights_only=True))
        assert accuracy(saved, xt, yt) == global_acc
    finally:
        stores[1].close()
        store0.destroy()
    assert replica > 0.85
    assert global_acc > replica - 0.03, (global_acc, replica)


def test_hybrid_leader_publishes_its_buffers(client, name, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    (x, y), (xt, yt) = digits()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    store = None
    try:
        model = bn_mlp()
        flat = FlatModel(model)
        store = ParameterStore.create(client, name, flat, scheme="hybrid", workers=1)
        ea = SEASGD(store, 0, 1, update_interval=4)
        hy = HybridSEASGD(flat, dist.new_group([0]), [0], seasgd=ea)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(EPOCHS):
            for lo in range(0, len(y) - BATCH + 1, BATCH):
                hy.zero_grad()
                F.cross_entropy(model(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
                hy.synchronize()
                opt.step()
                hy.after_step()
        hy.close()
        ea.close()
        replica = accuracy(model, xt, yt)
        evaluator = bn_mlp()
        store.load_into(evaluator)
        assert torch.equal(evaluator[1].running_var, model[1].running_var)
        global_acc = accuracy(evaluator, xt, yt)
    finally:
        if store is not None:
            store.destroy()
        dist.destroy_process_group()
    assert replica > 0.85
    assert global_acc > replica - 0.03, (global_acc, replica)
