"""Pure parts of the DDP-style loop and of the torchrun check: gradient hooks that end
every backward pass with a callback, and rank/world checked against torchrun's
variables."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import FlatModel, GradientHooks  # noqa: E402
from smb_client.torch.launch import check_torchrun  # noqa: E402
from smb_protocol.errors import InvalidArgument  # noqa: E402


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def test_every_backward_pass_ends_with_one_callback_after_optimizer_zero_grad():
    model = mlp()
    flat = FlatModel(model)
    ends: list[int] = []
    hooks: GradientHooks

    def after() -> None:
        ends.append(len(hooks.finish()))

    hooks = GradientHooks(flat, 16, lambda b: b, after_backward=after)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()                       # set_to_none: the hooks copy into the flat buffer
        model(torch.randn(4, 3)).sum().backward()
        assert model[0].weight.grad.data_ptr() == flat.grad_views[0].data_ptr()
        opt.step()
    assert ends == [len(hooks.buckets)] * 3
    hooks.paused = True                       # no_sync: no callback
    model(torch.randn(4, 3)).sum().backward()
    assert len(ends) == 3
    hooks.remove()


def test_an_error_at_the_end_of_backward_reaches_the_caller():
    model = mlp()

    def fail() -> None:
        raise InvalidArgument("boom")

    hooks = GradientHooks(FlatModel(model), 16, lambda b: b, after_backward=fail)
    with pytest.raises(InvalidArgument, match="boom"):
        model(torch.randn(4, 3)).sum().backward()
    hooks.remove()


def test_rank_and_world_are_checked_against_torchrun():
    check_torchrun(0, 5, "SyncDataParallel", {})                  # not under torchrun
    check_torchrun(2, 4, "SyncDataParallel", {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"})
    with pytest.raises(InvalidArgument, match=r"world=5.*WORLD_SIZE=4.*check_env=False"):
        check_torchrun(0, 5, "SyncDataParallel", {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    with pytest.raises(InvalidArgument, match=r"rank=1.*RANK=2"):
        check_torchrun(1, 4, "SyncDataParallel", {"RANK": "2", "WORLD_SIZE": "4"})
    with pytest.raises(InvalidArgument, match="LOCAL_RANK=5"):
        check_torchrun(1, 4, "SyncDataParallel", {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "5",
                                                  "LOCAL_WORLD_SIZE": "4"})
