"""Pure parts of smb_client.torch: flat layout, buckets, binding, hooks, torchrun variables."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ALIGN, FlatLayout, FlatModel, GradientHooks, StopRule, WorkerEnv, node_groups  # noqa: E402
from smb_protocol.errors import DtypeError, InvalidArgument  # noqa: E402


def mlp(hidden: int = 5) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def test_offsets_are_aligned_and_do_not_overlap():
    layout = FlatLayout.of([("a", (3,)), ("b", (4, 5)), ("c", ()), ("d", (0,)), ("e", (17,))])
    ends = 0
    for t in layout.tensors:
        assert t.offset % ALIGN == 0
        assert t.offset >= ends
        ends = t.offset + t.nbytes
    assert [t.numel for t in layout.tensors] == [3, 20, 1, 0, 17]
    assert layout.slot_bytes == 64 + 128 + 64 + 64 + 128
    assert layout.slot_bytes % ALIGN == 0
    assert layout.numel == 41


def test_segment_sizes_one_per_tensor_and_slot():
    layout = FlatLayout.of([("a", (3,)), ("b", (40,))])
    assert layout.segment_sizes() == [64, 192]
    assert layout.segment_sizes(3) == [64, 192] * 3
    assert sum(layout.segment_sizes(2)) == 2 * layout.slot_bytes
    with pytest.raises(InvalidArgument):
        layout.segment_sizes(0)


def test_stripe_unit_spreads_a_slot():
    layout = FlatLayout.of([("w", (1 << 20,))])      # 4 MiB
    assert layout.stripe_unit(4) == 1 << 20
    assert layout.stripe_unit(2) == 1 << 20          # capped at 1 MiB
    small = FlatLayout.of([("w", (3000,))])          # 12000 bytes
    assert small.stripe_unit(2) == 8192
    assert small.stripe_unit(1) == 12288


def test_buckets_cover_the_slot_backwards_without_gaps():
    layout = FlatLayout.of([(f"t{i}", (n,)) for i, n in enumerate([10, 300, 7, 64, 1000, 3])])
    buckets = layout.buckets(1024)
    assert buckets[0].last == len(layout.tensors) - 1
    assert buckets[-1].first == 0
    for a, b in itertools.pairwise(buckets):
        assert b.last == a.first - 1
        assert b.offset + b.length == a.offset
    assert buckets[0].offset + buckets[0].length == layout.slot_bytes
    assert sum(b.length for b in buckets) == layout.slot_bytes
    assert len(layout.buckets(1)) == len(layout.tensors)
    assert len(layout.buckets(1 << 30)) == 1
    with pytest.raises(InvalidArgument):
        layout.buckets(0)


def test_json_round_trip_and_mismatch_messages():
    layout = FlatLayout.of_module(mlp())
    again = FlatLayout.from_json(layout.to_json())
    assert again == layout
    layout.check_same(again)
    with pytest.raises(InvalidArgument, match="0.weight"):
        layout.check_same(FlatLayout.of_module(mlp(hidden=6)))
    with pytest.raises(InvalidArgument, match="parameter tensors"):
        layout.check_same(FlatLayout.of([("x", (1,))]))
    with pytest.raises(InvalidArgument):
        FlatLayout.from_json("{not json")
    with pytest.raises(InvalidArgument):
        FlatLayout.from_json('{"version": 99, "dtype": "float32", "align": 64, "tensors": []}')


def test_bad_models_give_typed_errors():
    with pytest.raises(DtypeError, match="float64"):
        FlatLayout.of_module(mlp().double())
    with pytest.raises(InvalidArgument, match="no parameters"):
        FlatLayout.of_module(torch.nn.ReLU())
    with pytest.raises(InvalidArgument, match="twice"):
        FlatLayout.of([("a", (1,)), ("a", (2,))])


def test_flat_model_binds_parameters_and_gradients_in_place():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    flat = FlatModel(model)
    for p, b, t in zip(model.parameters(), before, flat.layout.tensors, strict=True):
        assert torch.equal(p, b)
        start = t.offset // 4
        assert p.data_ptr() == flat.flat_params[start:].data_ptr()
    flat.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p, gv in zip(model.parameters(), flat.grad_views, strict=True):
        assert p.grad.data_ptr() == gv.data_ptr()       # accumulated in place
    opt.step()                                          # the optimizer sees the same Parameters
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.allclose(p, b - 0.5 * g)
    # padding stays zero
    covered = torch.zeros(flat.layout.slot_elements, dtype=torch.bool)
    for t in flat.layout.tensors:
        covered[t.offset // 4:t.offset // 4 + t.numel] = True
    assert torch.count_nonzero(flat.flat_params[~covered]) == 0


def test_collect_grad_copies_replaced_gradients_back():
    model = mlp()
    flat = FlatModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=True)
    model(torch.ones(2, 3)).sum().backward()
    expect = [p.grad.clone() for p in model.parameters()]
    assert model[0].weight.grad.data_ptr() != flat.grad_views[0].data_ptr()
    flat.collect_grads()
    for p, gv, e in zip(model.parameters(), flat.grad_views, expect, strict=True):
        assert p.grad.data_ptr() == gv.data_ptr()
        assert torch.equal(gv, e)
    model.to(torch.float64)
    with pytest.raises(InvalidArgument, match="moved out"):
        flat.check_bound()


def test_gradient_hooks_launch_buckets_in_order_during_backward():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    flat = FlatModel(model)
    launched: list[tuple[int, int, bool]] = []

    def launch(bucket):
        # the bucket's gradients are final when it is launched
        launched.append((bucket.first, bucket.last, backward_running[0]))
        return bucket.first

    backward_running = [False]
    hooks = GradientHooks(flat, 8 * 8 * 4 + 64, launch)       # about one layer per bucket
    flat.zero_grad()
    loss = model(torch.ones(1, 8)).sum()
    backward_running[0] = True
    loss.backward()
    backward_running[0] = False
    assert [b[:2] for b in launched] == [(b.first, b.last) for b in hooks.buckets]
    assert all(during for _, _, during in launched)
    assert hooks.finish() == [b.first for b in hooks.buckets]
    hooks.remove()


def test_gradient_hooks_finish_launches_unused_parameters():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    flat = FlatModel(model)
    flat.flat_grads.fill_(7.0)
    seen = []
    hooks = GradientHooks(flat, 1, lambda b: seen.append(b) or b)
    for p in model.parameters():
        p.grad = None
    model["used"](torch.ones(1, 2)).sum().backward()
    assert len(hooks.finish()) == len(hooks.buckets) == 4
    for name in ("unused.weight", "unused.bias"):
        i = [n for n, _ in model.named_parameters()].index(name)
        assert torch.count_nonzero(flat.grad_views[i]) == 0
    hooks.remove()


def test_worker_env_from_torchrun_variables():
    env = WorkerEnv.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                              "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)
    assert env.nodes == 2 and not env.is_master
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)
    alone = WorkerEnv.from_env({})
    assert (alone.rank, alone.world_size, alone.is_master) == (0, 1, True)
    with pytest.raises(InvalidArgument, match="RANK"):
        WorkerEnv.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(InvalidArgument, match="not an integer"):
        WorkerEnv.from_env({"RANK": "x"})
    with pytest.raises(InvalidArgument, match="LOCAL_WORLD_SIZE"):
        WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"})


def test_node_groups_and_stop_rules():
    assert node_groups(4, 2) == [[0, 1], [2, 3]]
    assert node_groups(3, 3) == [[0, 1, 2]]
    with pytest.raises(InvalidArgument):
        node_groups(4, 3)
    assert StopRule.parse("fastest") is StopRule.FASTEST
    with pytest.raises(InvalidArgument, match="master, fastest, average"):
        StopRule.parse("slowest")
