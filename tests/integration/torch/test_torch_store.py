"""The parameter store, hook pushes, SEASGD updates and shared counters on a real local
cluster (controller and two memory servers as processes, real sockets)."""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import SEASGD, ParameterStore, SharedCounters, SyncDataParallel, WorkerEnv, open_store  # noqa: E402
from smb_protocol.errors import DtypeError, InvalidArgument, RegionNotFound  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import release  # noqa: E402


def mlp(seed: int = 0, hidden: int = 24) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


@pytest.mark.parametrize("placement", ["striped", "layered"])
def test_create_attach_pull_push(client, name, placement):
    master = mlp(seed=1)
    store = ParameterStore.create(client, name, master, placement=placement, grad_slots=3,
                                  delta_slots=2, workers=2)
    try:
        other = mlp(seed=2)
        assert not torch.equal(other[0].weight, master[0].weight)
        attached = ParameterStore.attach(client, name, other)
        for a, b in zip(master.parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)
        # a push from one side is a pull on the other, in place
        with torch.no_grad():
            other[2].bias.add_(1.5)
        attached.push_params()
        store.pull_params()
        assert torch.equal(master[2].bias, other[2].bias)
        servers = store.tensor_servers()
        if placement == "layered":
            # layer-based sharding: each tensor whole on one server, both servers used
            for slot in range(3):
                per_tensor = store.tensor_servers("grads", slot)
                assert all(len(s) == 1 for s in per_tensor.values())
            assert len({s[0] for s in servers.values()}) == 2
        else:
            assert store.regions["params"].placement == "striped"
            assert len(store.regions["grads"].extents) == 2
        assert attached.traffic.received >= store.layout.slot_bytes
        attached.close()
    finally:
        store.destroy()
    assert client.list_regions(name) == []


def test_bad_input_gives_typed_errors(client, name):
    with pytest.raises(DtypeError, match="float32"):
        ParameterStore.create(client, name, mlp().double())
    store = ParameterStore.create(client, name, mlp(hidden=24), grad_slots=1)
    try:
        with pytest.raises(InvalidArgument, match="does not match"):
            ParameterStore.attach(client, name, mlp(hidden=25))
        with pytest.raises(InvalidArgument, match="grad_slots >= 3"):
            SyncDataParallel(store, 0, 1, exchange="slots")
        with pytest.raises(InvalidArgument, match="delta slot"):
            SEASGD(store, 0, 1)
        with pytest.raises(InvalidArgument, match="placement"):
            ParameterStore.create(client, name + "x", mlp(), placement="diagonal")
    finally:
        store.destroy()
    with pytest.raises(RegionNotFound, match="master creates"):
        ParameterStore.attach(client, name, mlp(), timeout=0.2)


@pytest.mark.parametrize("placement", ["striped", "layered"])
def test_hook_pushes_equal_a_push_after_backward(client, name, placement):
    """Gradients pushed bucket by bucket from backward hooks (overlap) land in the region
    exactly as one push of the whole gradient after backward does."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(4))
    results = {}
    for overlap in (True, False):
        model = mlp(seed=5)
        store = ParameterStore.create(client, f"{name}-{overlap}", model, placement=placement, grad_slots=3)
        dp = SyncDataParallel(store, 0, 1, overlap=overlap, bucket_bytes=512, exchange="slots")
        launched: list[object] = []
        if overlap:   # count the hooks' pushes (the backward pass also synchronizes)
            assert dp._hooks is not None
            push = dp._hooks._launch
            dp._hooks._launch = lambda bucket, seen=launched, push=push: seen.append(bucket) or push(bucket)
        try:
            for step in range(2):    # two steps: slot rotation and zeroing included
                dp.zero_grad()
                torch.nn.functional.cross_entropy(model(x[step * 8:(step + 1) * 8]),
                                                  y[step * 8:(step + 1) * 8]).backward()
                local = store.flat.flat_grads.clone()
                if overlap:
                    assert dp._hooks is not None and len(launched) == (step + 1) * len(dp._hooks.buckets)
                    assert len(dp._hooks.buckets) >= 3
                dp.synchronize()
                pushed = torch.from_numpy(store.regions["grads"].read(
                    store.slot_offset("grads", step), store.layout.slot_bytes, dtype="float32"))
                assert torch.equal(pushed, local)
                assert torch.equal(store.flat.flat_grads, local)   # world 1: the average is ours
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            results[overlap] = store.flat.flat_params.clone()
        finally:
            dp.close()
            store.destroy()
    assert torch.equal(results[True], results[False])


def test_seasgd_update_matches_hand_computation(client, name):
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(3.0)
    store = ParameterStore.create(client, name, model, delta_slots=2, workers=2)
    try:
        # the global weights: [[5, -2]], bias 1  (written by "another worker")
        g = store.flat.flat_params.clone()
        w0, b0 = store.layout.tensors[0].offset // 4, store.layout.tensors[1].offset // 4
        g[w0:w0 + 2] = torch.tensor([5.0, -2.0])
        g[b0] = 1.0
        store.regions["params"].write(0, g)
        ea = SEASGD(store, rank=1, world=2, moving_rate=0.25, update_interval=2)
        assert ea.after_step() is False          # step 1: no update
        assert ea.after_step() is True           # step 2: update
        ea.finish()
        # delta = 0.25 * (local - global) = 0.25 * ([1-5, 2+2], 3-1) = ([-1, 1], 0.5)
        assert model.weight.tolist() == [[2.0, 1.0]]        # local - delta
        assert model.bias.tolist() == [2.5]
        glob = store.regions["params"].read(0, store.layout.slot_bytes, dtype="float32")
        assert glob[w0:w0 + 2].tolist() == [4.0, -1.0]       # global + delta
        assert glob[b0] == 1.5
        delta = store.regions["deltas"].read(store.slot_offset("deltas", 1), store.layout.slot_bytes,
                                             dtype="float32")
        assert delta[w0:w0 + 2].tolist() == [-1.0, 1.0] and delta[b0] == 0.5
        untouched = store.regions["deltas"].read(0, store.layout.slot_bytes, dtype="float32")
        assert not untouched.any()                            # rank 0's private slot
        ea.close()
    finally:
        store.destroy()


def test_seasgd_workers_pull_global_weights_toward_them(cluster, name):
    """Three asynchronous workers fit one linear map from different shards; the global
    weights move from their zero start toward the workers and fit the data."""
    torch.manual_seed(0)
    true_w = torch.randn(4, 1)
    xs = torch.randn(300, 4)
    ys = xs @ true_w
    world, steps = 3, 60

    def make() -> torch.nn.Module:
        m = torch.nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            m.weight.zero_()
        return m

    with cluster.client() as master_client:
        master = ParameterStore.create(master_client, name, make(), delta_slots=world, workers=world)

        def worker(rank: int) -> torch.Tensor:
            with cluster.client() as c:
                model = make()
                store = ParameterStore.attach(c, name, model)
                ea = SEASGD(store, rank, world, update_interval=3)   # moving rate 0.3
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                for step in range(steps):
                    idx = torch.arange(rank, 300, world)[(step * 10) % 100:(step * 10) % 100 + 10]
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
                    opt.step()
                    ea.after_step()
                ea.close()
                assert ea.updates == steps // 3
                store.close()
                return model.weight.detach().clone().view(-1)

        finals = run_ranks(world, worker)
        glob = torch.from_numpy(master.regions["params"].read(0, 16, dtype="float32").copy())
        master.destroy()
    mean_local = torch.stack(finals).mean(0)
    start_gap = float(mean_local.norm())                     # the global weights started at 0
    assert float((glob - mean_local).norm()) < 0.5 * start_gap
    loss0 = float((ys ** 2).mean())
    loss = float(((xs @ glob.view(4, 1) - ys) ** 2).mean())
    assert loss < 0.2 * loss0, (loss, loss0)


def _run_counter_workers(cluster, name, rule, target, delays, lockstep=False):
    world = len(delays)
    with cluster.client() as c:
        region = c.create_region(name, 4096, placement="single")
        region.write(0, np.zeros(512, np.int64))

        def worker(rank: int) -> int:
            with cluster.client() as wc:
                r = wc.open_region(name)
                counters = SharedCounters(r, rank, world, rule, target, lockstep=lockstep)
                while not counters.tick():
                    time.sleep(delays[rank])      # the scenario: workers of different speeds
                    if counters.count > 20 * target:
                        raise AssertionError("never stopped")
                counters.finish()
                r.close()
                return counters.count

        try:
            out = run_ranks(world, worker, timeout=60)
            snap = SharedCounters(region, 0, world).snapshot()
        finally:
            region.close()
            c.delete_region(name)
    assert snap["counts"] == out
    assert snap["finished"] == world
    return snap


def test_stop_when_master_finishes(cluster, name):
    snap = _run_counter_workers(cluster, name, "master", 10, [0.03, 0.005, 0.005])
    assert snap["counts"][0] == 10 and snap["stop"] == 10
    assert all(c > 10 for c in snap["counts"][1:])           # faster workers did more


def test_stop_when_fastest_finishes(cluster, name):
    snap = _run_counter_workers(cluster, name, "fastest", 12, [0.03, 0.03, 0.003])
    assert snap["counts"][2] == 12 and snap["stop"] == 12
    assert all(c < 12 for c in snap["counts"][:2])


def test_stop_when_average_reaches_target(cluster, name):
    world, target = 3, 10
    snap = _run_counter_workers(cluster, name, "average", target, [0.02, 0.01, 0.003])
    assert target * world <= snap["total"] <= target * world + world
    assert snap["counts"][2] > target > snap["counts"][0]     # unequal speeds, average on target


def test_open_store_master_creates_others_attach(cluster, name):
    world = 3

    def worker(rank: int) -> torch.Tensor:
        with cluster.client() as c:
            model = mlp(seed=10 + rank)
            store = open_store(c, WorkerEnv(rank=rank, world_size=world, local_world_size=world),
                               name, model, grad_slots=3, workers=world)
            params = store.flat.flat_params.clone()
            c.barrier(f"{name}/done", world, timeout=30)
            release(store, rank)
            return params

    models = run_ranks(world, worker, timeout=60)
    assert torch.equal(models[1], models[0]) and torch.equal(models[2], models[0])


class _Counting:
    """A real region whose requests are counted (every method call that reaches a server)."""

    def __init__(self, region):
        self.region, self.calls = region, []

    def __getattr__(self, attr):
        value = getattr(self.region, attr)
        if attr in ("fetch_add", "fetch_add_many", "compare_swap", "read", "write"):
            def counted(*args, **kwargs):
                self.calls.append(attr)
                return value(*args, **kwargs)
            return counted
        return value


@pytest.mark.parametrize("rule", ["master", "fastest", "average"])
def test_a_tick_is_one_request_until_the_rule_fires(client, name, rule):
    region = client.create_region(name, 4096, placement="single")
    try:
        counting = _Counting(region)
        counters = SharedCounters(counting, 1, 2, rule, target=3)
        assert not counters.tick() and not counters.tick()
        assert counting.calls == ["fetch_add_many"] * 2
        counting.calls.clear()
        if rule == "master":                      # rank 1 never fires it; rank 0 does
            assert not counters.tick()
            SharedCounters(region, 0, 2, rule, target=3).tick(3)
            assert counters.tick()
            assert counting.calls == ["fetch_add_many"] * 2
        else:                                     # fastest: its 3rd step fires it; average: 6 in all
            assert counters.tick(1 if rule == "fastest" else 4)
            assert counting.calls == ["fetch_add_many", "compare_swap"]
        snap = SharedCounters(region, 0, 2).snapshot()
        assert snap["stop"] == (3 if rule == "master" else counters.count)
        assert snap["counts"][1] == counters.count
    finally:
        client.delete_region(name)


@pytest.mark.parametrize("order", ["rank 1 reads first", "rank 0 asks first"])
def test_a_stop_asked_between_lockstep_steps_stops_everyone_after_the_same_step(client, name, order):
    # rank 0 asks everyone to stop after its step, once it read the stop word; rank 1 reads
    # the word for the same step before or after the request: both stop after the same step
    region = client.create_region(name, 4096, placement="single")
    try:
        ranks = [SharedCounters(region, r, 2, "master", lockstep=True) for r in range(2)]
        stopped_after: dict[int, int] = {}
        for step in range(1, 5):
            for r in (0, 1):
                if r not in stopped_after:
                    ranks[r].publish()                    # before the step's exchange
            # ... the step's exchange: every published count is visible from here on
            reads = {}
            if 0 not in stopped_after:
                reads[0] = ranks[0].should_stop()
            if step == 2 and order == "rank 1 reads first":
                reads[1] = ranks[1].should_stop()
                ranks[0].request_stop()
            elif step == 2:
                ranks[0].request_stop()
                reads[1] = ranks[1].should_stop()
            elif 1 not in stopped_after:
                reads[1] = ranks[1].should_stop()
            for r, stop in reads.items():
                if stop:
                    stopped_after[r] = step
        assert stopped_after == {0: 3, 1: 3}
    finally:
        client.delete_region(name)
