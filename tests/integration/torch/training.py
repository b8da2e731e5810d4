"""The training steps of the torch tests, on a slice of a data set with cross entropy for
loss: a step of one process, a synchronous data-parallel step, and what the workers'
steps together should equal. Import it after ``pytest.importorskip("torch")``."""
from __future__ import annotations

from typing import Any

import torch


def rank_batch(step: int, rank: int, world: int, batch: int) -> slice:
    """The samples ``rank`` of ``world`` trains on at ``step`` when each rank takes
    ``batch`` samples a step, the ranks' batches one after the other."""
    lo = (step * world + rank) * batch
    return slice(lo, lo + batch)


def local_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               batch: slice) -> None:
    """One optimizer step of ``model`` on samples ``batch`` of ``x`` and ``y``."""
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
    opt.step()


def sync_step(dp: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              batch: slice) -> None:
    """One synchronous step of ``model`` on samples ``batch`` of ``x`` and ``y``: its
    gradients go through ``dp`` (a SyncDataParallel) before ``opt`` steps."""
    dp.zero_grad()
    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
    dp.synchronize()
    opt.step()


def train_on_the_union(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                       steps: int, per_step: int) -> None:
    """What ``steps`` synchronous steps of several workers should equal: one process
    taking each step on every worker's samples of it (``per_step`` samples in all, in order)."""
    for step in range(steps):
        local_step(model, opt, x, y, slice(step * per_step, (step + 1) * per_step))
