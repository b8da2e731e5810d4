"""Buffers (batch-norm statistics) under synchronous training: broadcast from rank 0
(the default, as DDP), averaged, or left alone (worker threads with their own clients on
a real local cluster, each seeing different data)."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_protocol.errors import InvalidArgument  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import rank_store, release  # noqa: E402

WORLD = 2
STEPS = 3
BATCH = 8


def cnn() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    # every worker its own data, with its own mean and spread: the statistics drift apart
    x = torch.randn(STEPS * BATCH, 1, 8, 8, generator=g) * (1 + 2 * rank) + 3 * rank
    return x, torch.randint(0, 3, (STEPS * BATCH,), generator=g)


def buffers_of(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def train(cluster, name, mode):
    """Each worker's buffers just before the last synchronization and at the end."""
    ready = threading.Event()

    def worker(rank: int) -> tuple[dict, dict, torch.Tensor]:
        try:
            with cluster.client() as c:
                model = cnn()
                store = rank_store(c, rank, name, model, ready, workers=WORLD)
                kwargs = {} if mode is None else {"buffers": mode}
                dp = SyncDataParallel(store, rank, WORLD, bucket_bytes=512, **kwargs)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                x, y = data(rank)
                before: dict = {}
                for step in range(STEPS):
                    dp.zero_grad()
                    xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
                    out = model(xb)                 # the forward pass updates the statistics
                    before = buffers_of(model)      # before the backward pass synchronizes them
                    torch.nn.functional.cross_entropy(out, yb).backward()
                    dp.synchronize()
                    opt.step()
                dp.close()
                c.barrier(f"{name}/end", WORLD, timeout=60)
                result = (before, buffers_of(model), store.flat.flat_params.clone())
                c.barrier(f"{name}/read", WORLD, timeout=60)
                release(store, rank)
                return result
        finally:
            ready.set()              # a rank 0 that failed keeps nobody waiting

    return run_ranks(WORLD, worker)


@pytest.mark.parametrize("mode", [None, "broadcast"])
def test_broadcast_gives_every_replica_rank_0s_buffers(cluster, name, mode):
    res = train(cluster, name, mode)
    (pre0, post0, params0), (pre1, post1, params1) = res[0], res[1]
    assert set(post0) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert not torch.allclose(pre0["1.running_mean"], pre1["1.running_mean"])   # they did drift
    for n in post0:
        assert torch.equal(post0[n], pre0[n]), n      # rank 0 keeps its own
        assert torch.equal(post1[n], post0[n]), n     # the others get them
    assert int(post0["1.num_batches_tracked"]) == STEPS
    assert torch.equal(params0, params1)


def test_average_gives_every_replica_the_mean(cluster, name):
    res = train(cluster, name, "average")
    (pre0, post0, _), (pre1, post1, _) = res[0], res[1]
    assert not torch.allclose(pre0["1.running_var"], pre1["1.running_var"])
    for n in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(post0[n], (pre0[n] + pre1[n]) * 0.5, rtol=1e-6, atol=1e-7)
        assert torch.equal(post1[n], post0[n]), n
    assert torch.equal(post0["1.num_batches_tracked"], pre0["1.num_batches_tracked"])
    assert torch.equal(post1["1.num_batches_tracked"], post0["1.num_batches_tracked"])


def test_none_leaves_each_replica_its_own(cluster, name):
    res = train(cluster, name, "none")
    (pre0, post0, _), (pre1, post1, _) = res[0], res[1]
    for n in post0:
        assert torch.equal(post0[n], pre0[n]) and torch.equal(post1[n], pre1[n]), n
    assert not torch.allclose(post0["1.running_mean"], post1["1.running_mean"])


def test_store_holds_and_hands_out_the_buffers(client, name):
    model = cnn()
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
    store = ParameterStore.create(client, name, model)
    try:
        assert name + "/buffers" in {r.name for r in client.list_regions(name)}
        other = cnn()
        attached = ParameterStore.attach(client, name, other)        # pulls the buffers too
        assert torch.equal(other[1].running_mean, model[1].running_mean)
        evaluator = cnn()
        store.load_into(evaluator)
        assert torch.equal(evaluator[1].running_mean, model[1].running_mean)
        with pytest.raises(InvalidArgument, match="buffers"):
            SyncDataParallel(attached, 0, 1, buffers="sometimes")
        attached.close()
    finally:
        store.destroy()
    bare = ParameterStore.create(client, name, cnn(), buffers=False)
    try:
        assert "buffers" not in bare.regions
        with pytest.raises(InvalidArgument, match="holds no buffers"):
            SyncDataParallel(bare, 0, 1)
        SyncDataParallel(bare, 0, 1, buffers="none").close(publish=False)
    finally:
        bare.destroy()
