"""torch CPU tensors through the data plane, over tcp and shm: zero-copy writes and reads,
and bfloat16 sums as torch rounds them."""
from __future__ import annotations

import numpy as np
import torch

from smb_protocol.dtypes import bf16_to_f32, f32_to_bf16

MiB = 1 << 20


def test_torch_tensors_zero_copy(tclient, name):
    r = tclient.create_region(name, 4 * MiB)
    t = torch.arange(MiB, dtype=torch.float32)
    r.write(0, t)
    out = torch.empty(MiB, dtype=torch.float32)
    r.read_into(0, out)
    assert torch.equal(out, t)
    b = torch.randn(1000).to(torch.bfloat16)
    r.write(8, b)
    back = torch.empty(1000, dtype=torch.bfloat16)
    r.read_into(8, back)
    assert torch.equal(back, b)
    tclient.delete_region(name)


def test_accumulate_bfloat16_rounds_as_torch(tclient, name):
    n = 100_000
    r = tclient.create_region(name, n * 2, stripe_unit=32 << 10)
    a = torch.randn(n).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    r.write(0, a)
    r.accumulate(0, b)
    out = torch.empty(n, dtype=torch.bfloat16)
    r.read_into(0, out)
    assert torch.equal(out, a + b)  # torch rounds bf16 adds to nearest-even, as the server
    tclient.delete_region(name)


def test_bf16_helpers_match_torch():
    x = torch.randn(10_000) * 100
    ours = f32_to_bf16(x.numpy())
    assert np.array_equal(ours, x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(bf16_to_f32(ours), x.to(torch.bfloat16).float().numpy())
