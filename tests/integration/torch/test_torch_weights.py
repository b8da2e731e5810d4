"""A torch model's weights from a trainer to readers: published from the model, read in
place into a bfloat16 reader model and into a tensor-parallel half of a model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch.weights import load, publish, publisher, tensor_parallel, to_torch  # noqa: E402
from smb_client.weights import Subscriber  # noqa: E402


def make_model(seed: int, hidden: int = 64, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.LayerNorm(hidden),
                               torch.nn.Linear(hidden, 4)).to(dtype)


def test_a_reader_model_loads_each_version_in_place_in_its_own_type(cluster, name):
    trainer = make_model(1)
    reader_model = make_model(2, dtype=torch.bfloat16)
    with cluster.client() as tc, cluster.client(transport="shm") as rc:
        pub = publisher(tc, name, trainer, versions=2)
        try:
            sub = Subscriber(rc, name)
            weight = reader_model[0].weight
            held = None
            for step in range(3):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(0.25)
                publish(pub, trainer, version=10 * step)
                held = load(sub, reader_model, newer_than=held, timeout=30)
                assert held == 10 * step
                assert reader_model[0].weight is weight                  # in place
                for (k, want), got in zip(trainer.state_dict().items(), reader_model.state_dict().values(),
                                          strict=True):
                    assert got.dtype == torch.bfloat16
                    assert torch.equal(got, want.to(torch.bfloat16)), k
            raw = to_torch(sub.read(names=["0.weight"], dtype="bfloat16"))
            assert torch.equal(raw["0.weight"], trainer[0].weight.detach().to(torch.bfloat16))
        finally:
            pub.delete()


def test_a_tensor_parallel_reader_loads_its_half(cluster, name):
    """Rank 1 of 2: the first layer split by output rows, the second by input columns."""
    trainer = make_model(3)
    with cluster.client() as tc, cluster.client() as rc:
        pub = publisher(tc, name, trainer)
        try:
            publish(pub, trainer)
            sub = Subscriber(rc, name)
            half = {"0.weight": torch.empty(32, 16), "0.bias": torch.empty(32), "2.weight": torch.empty(4, 32)}
            shards = tensor_parallel(half, {"0.*": 0, "2.weight": 1}, index=1, parts=2)
            assert load(sub, half, shards=shards, strict=False) == 0
            w = trainer.state_dict()
            assert torch.equal(half["0.weight"], w["0.weight"][32:])
            assert torch.equal(half["0.bias"], w["0.bias"][32:])
            assert torch.equal(half["2.weight"], w["2.weight"][:, 32:])
        finally:
            pub.delete()
