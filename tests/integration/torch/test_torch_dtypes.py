"""bfloat16, float16 and mixed-type parameter stores: gradients are accumulated in each
parameter's own type; with integer-valued data every sum is exact, so synchronous
training equals one process on the union of the batches bit for bit (worker threads
with their own clients on a real local cluster)."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import SEASGD, ParameterStore, SyncDataParallel  # noqa: E402
from smb_protocol.errors import DtypeError  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import rank_store, release  # noqa: E402

WORLD = 2
STEPS = 3
BATCH = 2
LR = 0.25

KINDS = {"bfloat16": [torch.bfloat16], "float16": [torch.float16],
         "mixed": [torch.float32, torch.bfloat16, torch.float16]}


class Heads(torch.nn.Module):
    """One linear head per element type, each fed the input in its own type."""

    def __init__(self, dtypes) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.heads = torch.nn.ModuleList()
        for dt in dtypes:
            head = torch.nn.Linear(4, 3)
            with torch.no_grad():   # small integers: every product and sum below is exact
                head.weight.copy_(torch.randint(-2, 3, (3, 4), generator=g).float())
                head.bias.copy_(torch.randint(-2, 3, (3,), generator=g).float())
            self.heads.append(head.to(dt))

    def forward(self, x):
        return sum((h(x.to(h.weight.dtype)).float() for h in self.heads), torch.zeros(()))


def data():
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-2, 3, (STEPS * WORLD * BATCH, 4), generator=g).float()
    c = torch.randint(-1, 2, (STEPS * WORLD * BATCH, 3), generator=g).float()
    return x, c


def loss(model, x, c):
    return (model(x) * c).sum()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("overlap", [True, False])
def test_sync_is_exact_in_every_type(cluster, name, kind, overlap):
    x, c = data()
    ready = threading.Event()

    def worker(rank: int) -> dict:
        try:
            with cluster.client() as cl:
                model = Heads(KINDS[kind])
                store = rank_store(cl, rank, name, model, ready, workers=WORLD)
                assert store.flat.flat_params.dtype == (torch.uint8 if kind == "mixed" else KINDS[kind][0])
                dp = SyncDataParallel(store, rank, WORLD, overlap=overlap, bucket_bytes=64)
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                for step in range(STEPS):
                    lo = (step * WORLD + rank) * BATCH
                    dp.zero_grad()
                    loss(model, x[lo:lo + BATCH], c[lo:lo + BATCH]).backward()
                    dp.synchronize()
                    opt.step()
                dp.close()
                cl.barrier(f"{name}/end", WORLD, timeout=60)
                weights = {k: v.clone() for k, v in model.state_dict().items()}
                stored = store.state_dict()
                for k, v in stored.items():
                    assert torch.equal(v, weights[k]), k        # the published weights
                cl.barrier(f"{name}/read", WORLD, timeout=60)
                release(store, rank)
                return weights
        finally:
            ready.set()              # a rank 0 that failed keeps nobody waiting

    results = run_ranks(WORLD, worker)
    ref = Heads(KINDS[kind])
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        lo, hi = step * WORLD * BATCH, (step + 1) * WORLD * BATCH
        opt.zero_grad()
        (loss(ref, x[lo:hi], c[lo:hi]) / WORLD).backward()
        opt.step()
    for rank in range(WORLD):
        for k, v in ref.state_dict().items():
            assert results[rank][k].dtype == v.dtype
            assert torch.equal(results[rank][k], v), (rank, k)
    assert any(not torch.equal(start[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("kind", list(KINDS))
def test_seasgd_update_is_exact_in_every_type(client, name, kind):
    model = Heads(KINDS[kind])
    store = ParameterStore.create(client, name, model, scheme="seasgd", workers=2)
    try:
        local = {k: v.clone() for k, v in model.state_dict().items()}
        glob = {k: v + 4 for k, v in local.items()}          # "another worker" moved the global weights
        other = Heads(KINDS[kind])
        other.load_state_dict(glob)
        writer = ParameterStore.attach(client, name, other, pull=False)
        writer.push_params()
        ea = SEASGD(store, rank=0, world=2, moving_rate=0.25, update_interval=1)
        assert ea.after_step() is True
        ea.finish()
        # delta = 0.25 * (local - global) = -1 everywhere
        for k, v in model.state_dict().items():
            assert torch.equal(v, local[k] + 1), k                         # local - delta
        stored = store.state_dict()
        for k, v in stored.items():
            assert v.dtype == local[k].dtype and torch.equal(v, glob[k] - 1), k   # global + delta
        ea.close()
        writer.close()
    finally:
        store.destroy()


def test_attach_checks_the_element_types(client, name):
    store = ParameterStore.create(client, name, Heads([torch.bfloat16]))
    try:
        with pytest.raises(DtypeError, match="bfloat16"):
            ParameterStore.attach(client, name, Heads([torch.float16]))
        attached = ParameterStore.attach(client, name, Heads([torch.bfloat16]))
        assert attached.layout.tensors[0].dtype == "bfloat16"
        assert store.regions["params"].size == store.layout.slot_bytes
        attached.close()
    finally:
        store.destroy()
