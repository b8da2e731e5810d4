"""Synchronous training publishes the weights into the store: every publish_every
steps and at close, so an evaluator or a late joiner reads the trained weights
(worker threads and an evaluator thread on a real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import release  # noqa: E402
from tests.integration.torch.training import rank_batch, sync_step  # noqa: E402

WORLD = 2
BATCH = 8
STEPS = 5


def make_model(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))


def flat_of(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("placement", ["striped", "layered"])
def test_evaluator_reads_the_trained_weights(cluster, name, placement):
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(STEPS * WORLD * BATCH, 6, generator=g), torch.randint(0, 3, (STEPS * WORLD * BATCH,),
                                                                            generator=g)
    models = [make_model() for _ in range(WORLD)]
    initial = flat_of(models[0]).clone()
    snapshots: dict[int, list[torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}

    def worker(rank):
        with cluster.client() as c:
            model = models[rank]
            if rank == 0:
                store = ParameterStore.create(c, name, model, placement=placement, grad_slots=3, workers=WORLD)
            c.barrier(f"{name}/ready", WORLD + 1, timeout=60)
            if rank:
                store = ParameterStore.attach(c, name, model)
            dp = SyncDataParallel(store, rank, WORLD, publish_every=2)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            snaps = snapshots.setdefault(rank, [flat_of(model).clone()])
            for step in range(STEPS):
                sync_step(dp, model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
                snaps.append(flat_of(model).clone())
            c.barrier(f"{name}/trained", WORLD + 1, timeout=60)    # the evaluator looks
            c.barrier(f"{name}/looked", WORLD + 1, timeout=60)
            dp.close()                                              # publishes the last step
            c.barrier(f"{name}/closed", WORLD + 1, timeout=60)
            c.barrier(f"{name}/done", WORLD + 1, timeout=60)
            release(store, rank)

    def evaluator():
        with cluster.client() as c:
            c.barrier(f"{name}/ready", WORLD + 1, timeout=60)
            c.barrier(f"{name}/trained", WORLD + 1, timeout=60)
            model = make_model(seed=99)
            store = ParameterStore.attach(c, name, model)       # a late joiner, mid-training
            seen["trained"] = flat_of(model).clone()
            c.barrier(f"{name}/looked", WORLD + 1, timeout=60)
            c.barrier(f"{name}/closed", WORLD + 1, timeout=60)
            evaluation = make_model(seed=98)
            store.load_into(evaluation)                          # an evaluator, after training
            seen["closed"] = flat_of(evaluation).clone()
            store.close()
            c.barrier(f"{name}/done", WORLD + 1, timeout=60)

    run_ranks(WORLD + 1, lambda rank: worker(rank) if rank < WORLD else evaluator())   # the last: the evaluator
    assert torch.equal(snapshots[0][-1], snapshots[1][-1])
    # published at the synchronize of step 4: the weights after 4 optimizer steps
    assert torch.equal(seen["trained"], snapshots[0][4])
    assert torch.equal(seen["closed"], snapshots[0][STEPS])
    assert not torch.equal(seen["closed"], initial)
