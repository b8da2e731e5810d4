"""Checkpoints: store.save(path) writes a state dict torch.load reads; store.load(path)
puts one back into the store and the bound model (real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_protocol.errors import DtypeError, InvalidArgument  # noqa: E402


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))


def test_save_load_round_trip(client, name, tmp_path):
    model = net(1)
    store = ParameterStore.create(client, name, model)
    try:
        # train a little so that the weights and statistics are not the initial ones
        with SyncDataParallel(store, 0, 1) as dp:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                dp.zero_grad()
                model(torch.randn(4, 1, 6, 6) + 1).sum().backward()
                dp.synchronize()
                opt.step()
        path = tmp_path / "ckpt.pt"
        store.save(path)
        state = torch.load(path, weights_only=True)
        assert list(state) == list(model.state_dict())                # parameters and buffers, by name
        for k, v in model.state_dict().items():
            assert torch.equal(state[k], v), k
        assert int(state["1.num_batches_tracked"]) == 3
        fresh = net(2)
        fresh.load_state_dict(state)                                  # a plain state dict
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(),
                                                         strict=True))
    finally:
        store.destroy()

    # loading into another store: the store and its model get the checkpoint's weights
    other = net(3)
    store2 = ParameterStore.create(client, name, other)
    try:
        assert not torch.equal(other[0].weight, state["0.weight"])
        store2.load(path)
        for k, v in other.state_dict().items():
            assert torch.equal(v, state[k]), k
        evaluator = net(4)
        store2.load_into(evaluator)
        for k, v in evaluator.state_dict().items():
            assert torch.equal(v, state[k]), k
        late = ParameterStore.attach(client, name, net(5))           # a late joiner pulls them
        for k, v in late.flat.model.state_dict().items():
            assert torch.equal(v, state[k]), k
        late.close()
        bad = dict(state)
        del bad["4.bias"]
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(InvalidArgument, match="4.bias"):
            store2.load(tmp_path / "bad.pt")
        bad = dict(state, **{"4.bias": state["4.bias"].double()})
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(DtypeError, match="4.bias"):
            store2.load(tmp_path / "bad.pt")
    finally:
        store2.destroy()


def test_checkpoint_of_a_store_without_buffers(client, name, tmp_path):
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    store = ParameterStore.create(client, name, model, buffers=False)
    try:
        store.save(tmp_path / "w.pt")
        state = torch.load(tmp_path / "w.pt", weights_only=True)
        assert set(state) == {"weight", "bias"} and state["weight"].dtype == torch.bfloat16
        assert torch.equal(state["weight"], model.weight)
    finally:
        store.destroy()
