"""ParameterStore.create: slot counts default per scheme, and replacing an existing
store must be asked for (real local cluster)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import SEASGD, ParameterStore, SyncDataParallel  # noqa: E402
from smb_protocol.errors import InvalidArgument, RegionExists  # noqa: E402


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def train_one_step(store, model, **kwargs) -> None:
    with SyncDataParallel(store, 0, 1, **kwargs) as dp:
        dp.zero_grad()
        model(torch.ones(3, 5).to(model[0].weight.dtype)).float().sum().backward()
        dp.synchronize()


def test_default_slots_suit_synchronous_training(client, name):
    """The collective exchange (the default for a one-type model) uses no gradient slot,
    so none is reserved: the regions hold the parameters once, and nothing else of the
    model's size."""
    model = mlp()
    store = ParameterStore.create(client, name, model)
    try:
        assert (store.grad_slots, store.delta_slots) == (0, 0)
        slot = store.layout.slot_bytes
        sizes = {r.name.rsplit("/", 1)[1]: r.size for r in client.list_regions(f"{name}/")}
        assert set(sizes) == {"meta", "params", "counters"}, sizes
        assert sizes["params"] == slot
        train_one_step(store, model)
        sizes = {r.name.rsplit("/", 1)[1]: r.size for r in client.list_regions(f"{name}/")}
        assert "grads" not in sizes and "allreduce" in sizes      # the collective's own region
        with pytest.raises(InvalidArgument, match="grad_slots=3"):
            SyncDataParallel(store, 0, 1, exchange="slots")
    finally:
        store.destroy()


def test_the_slot_exchange_gets_its_slots(client, name):
    model = mlp()
    store = ParameterStore.create(client, name, model, grad_slots=3)   # asked for: exchange="slots"
    try:
        assert store.regions["grads"].size == 3 * store.layout.slot_bytes
        train_one_step(store, model, exchange="slots")
    finally:
        store.destroy()
    mixed = torch.nn.Sequential(torch.nn.Linear(5, 12).to(torch.bfloat16), torch.nn.Linear(12, 2))
    store = ParameterStore.create(client, name, mixed)                 # mixed types: "slots" by default
    try:
        assert (store.grad_slots, store.delta_slots) == (3, 0)
        with SyncDataParallel(store, 0, 1) as dp:
            assert dp.exchange == "slots"
            dp.zero_grad()
            mixed[1](mixed[0](torch.ones(3, 5, dtype=torch.bfloat16)).float()).sum().backward()
            dp.synchronize()
    finally:
        store.destroy()


@pytest.mark.parametrize("scheme", ["seasgd", "hybrid"])
def test_asynchronous_schemes_get_a_delta_slot_per_worker(client, name, scheme):
    store = ParameterStore.create(client, name, mlp(), scheme=scheme, workers=3)
    try:
        assert (store.grad_slots, store.delta_slots) == (0, 3)
        assert "grads" not in store.regions
        SEASGD(store, 2, 3).close()
    finally:
        store.destroy()


def test_given_counts_win(client, name):
    store = ParameterStore.create(client, name, mlp(), scheme="sync", grad_slots=4, delta_slots=1)
    try:
        assert (store.grad_slots, store.delta_slots) == (4, 1)
    finally:
        store.destroy()
    store = ParameterStore.create(client, name, mlp(), delta_slots=2, workers=2)   # only deltas given
    try:
        assert (store.grad_slots, store.delta_slots) == (0, 2)
    finally:
        store.destroy()
    with pytest.raises(InvalidArgument, match="scheme"):
        ParameterStore.create(client, name, mlp(), scheme="allreduce")
    assert client.list_regions(f"{name}/") == []


def test_an_existing_store_is_replaced_only_when_asked(client, name):
    first = ParameterStore.create(client, name, mlp(seed=1))
    try:
        with pytest.raises(RegionExists, match="replace=True"):
            ParameterStore.create(client, name, mlp(seed=2))
        # the existing store is intact
        other = mlp(seed=3)
        ParameterStore.attach(client, name, other).close()
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), mlp(seed=1).parameters(), strict=True))
        first.close()
        second = ParameterStore.create(client, name, mlp(seed=2), replace=True)
        second.close()
        again = mlp(seed=3)
        ParameterStore.attach(client, name, again).close()
        assert all(torch.equal(a, b) for a, b in zip(again.parameters(), mlp(seed=2).parameters(), strict=True))
    finally:
        ParameterStore.destroy_prefix(client, name)


def test_a_leftover_region_counts_as_an_existing_store(client, name):
    client.create_region(f"{name}/counters", 4096).close()
    try:
        with pytest.raises(RegionExists, match="counters"):
            ParameterStore.create(client, name, mlp())
        assert [r.name for r in client.list_regions(f"{name}/")] == [f"{name}/counters"]
        # a store under a longer prefix is another store
        ParameterStore.create(client, f"{name}/counters2", mlp()).destroy()
    finally:
        client.delete_region(f"{name}/counters")
