"""A DDP-style training loop on ``smb_client.torch.DistributedDataParallel``, run by
``torchrun`` in tests/integration/torch/test_ddp_restart.py: each rank writes its step to
``<out>/progress-<rank>-<restart>`` as it goes and, at the end, what it saw as JSON."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import smb_client.torch as smbt

STEPS = int(os.environ.get("DDP_TEST_STEPS", "400"))


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = smbt.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    progress = Path(out) / f"progress-{rank}-{restart}"
    first = [p.detach().clone() for p in ddp.parameters()]
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=g)
        y = (x[:, 0] > 0).long()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        progress.write_text(str(step + 1))
    weights = [p.detach() for p in ddp.parameters()]
    result = {"rank": rank, "restart": restart, "resumed": ddp.job.resumed, "steps": STEPS,
              "started_from_the_seed": all(torch.equal(a, b) for a, b in zip(first, _seeded(), strict=True)),
              "weights_sum": float(sum(w.double().sum() for w in weights))}
    ddp.close()
    (Path(out) / f"result-{rank}.json").write_text(json.dumps(result))


def _seeded() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return [p.detach() for p in model.parameters()]


if __name__ == "__main__":
    main(sys.argv[1])
