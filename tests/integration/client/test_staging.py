"""The staging pipelines of :mod:`smb_client.cuda`, run without a CUDA device: a
:class:`~smb_client.cuda.HostLane` copies at once, so chunking, buffer reuse, the
piecewise collective round and the copies back are checked against the plain path on a
real local cluster (the same code moves CUDA tensors in tests/cuda)."""
from __future__ import annotations

import numpy as np
import pytest

from smb_client import cuda, cuda_region, cuda_round
from tests.integration.client.parties import run_parties

torch = pytest.importorskip("torch")

CHUNK = 4096      # bytes per staging buffer: many chunks per operation
CHUNK_BYTES = 8192   # bytes per chunk of the collectives


def _stager() -> cuda.Stager:
    return cuda.Stager(cuda.HostLane(), chunk=CHUNK, buffers=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_region_ops_match_the_plain_path(client, name, dtype):
    n = 10_000 + 3   # not a whole number of chunks
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(n, generator=gen) * 100).to(dtype)
    nbytes = data.numel() * data.element_size()
    staged, plain = client.create_region(name, 2 * nbytes + 64), client.create_region(name + "-plain", 2 * nbytes + 64)
    try:
        st = _stager()
        cuda_region.write(staged, 64, data, stager=st)
        plain.write(64, data if dtype != torch.uint8 else data.numpy())
        assert bytes(staged.read(0, staged.size)) == bytes(plain.read(0, plain.size))
        if dtype != torch.uint8:
            cuda_region.accumulate(staged, 64, data, stager=st)
            plain.accumulate(64, data)
            if dtype.is_floating_point:
                cuda_region.accumulate(staged, 64, data, alpha=0.5, stager=st)
                plain.axpy(64, data, 0.5)
            assert bytes(staged.read(0, staged.size)) == bytes(plain.read(0, plain.size))
        out = torch.zeros_like(data)
        assert cuda_region.read_into(staged, 64, out, stager=st) is out
        want = torch.zeros_like(data)
        plain.read_into(64, want if dtype != torch.uint8 else want.numpy())
        assert torch.equal(out, want)
        assert st.lane.copies >= 2 * (nbytes // CHUNK)
    finally:
        client.delete_region(name)
        client.delete_region(name + "-plain")


def test_many_forms(client, name):
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(500, dtype=torch.int64)
    region = client.create_region(name, 1 << 16)
    try:
        st = _stager()
        cuda_region.write_many(region, [(0, a), (8192, b), (16384, b.numpy())], stager=st)
        cuda_region.write_many(region, [(0, a)], accumulate_as=None, stager=st)
        outs = cuda_region.read_many(region, [(0, torch.zeros_like(a)), (8192, torch.zeros_like(b)),
                                       (16384, np.zeros(500, dtype=np.int64))], stager=st)
        assert torch.equal(outs[0], 2 * a) and torch.equal(outs[1], b)
        assert np.array_equal(outs[2], b.numpy())
    finally:
        client.delete_region(name)


def test_all_reduce_whole_and_piecewise(cluster, name):
    parties, n = 3, 20_000
    # whole numbers: exact sums in any arrival order
    inputs = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(r)).float()
              for r in range(parties)]
    runs = [(0, 4000), (8000, 40_000), (60_000, 20_000)]          # bytes; the rest stays
    results: dict[tuple[str, int], torch.Tensor] = {}

    def body(coll, rank):
        st = _stager()
        for _ in range(2):
            whole = inputs[rank].clone()
            cuda_round.begin(coll, whole, stager=st).finish()
            results["whole", rank] = whole
            piece = inputs[rank].clone()
            staged = cuda_round.begin(coll, piece, runs=runs, hold=0, stager=st)
            for off in range(n * 4 - 4000, -1, -4000):        # backward order, in buckets
                staged.ready(off, 4000)
            staged.finish()
            results["piece", rank] = piece
            plain = inputs[rank].clone()
            coll.begin(plain, runs=runs, hold=0).finish()
            results["plain", rank] = plain
    run_parties(cluster, name, parties, n * 4, CHUNK_BYTES, None, body)
    total = inputs[0].clone()
    for t in inputs[1:]:
        total += t
    inside = torch.zeros(n, dtype=torch.bool)
    for off, length in runs:
        inside[off // 4:(off + length) // 4] = True
    for rank in range(parties):
        assert torch.equal(results["whole", rank], total)
        assert torch.equal(results["plain", rank], torch.where(inside, total, inputs[rank]))
        assert torch.equal(results["piece", rank], results["plain", rank])


def test_all_reduce_integers_exact(cluster, name):
    parties, n = 2, 30_001
    inputs = [torch.arange(n, dtype=torch.int64) * (r + 1) for r in range(parties)]
    got = {}

    def body(coll, rank):
        t = inputs[rank].clone()
        cuda_round.begin(coll, t, stager=_stager()).finish()
        got[rank] = t
    run_parties(cluster, name, parties, n * 8, CHUNK_BYTES, None, body)
    for rank in range(parties):
        assert torch.equal(got[rank], inputs[0] + inputs[1])


def test_broadcast(cluster, name):
    parties, n = 3, 12_345
    got = {}

    def body(coll, rank):
        t = torch.arange(n, dtype=torch.float32) if rank == 1 else torch.zeros(n)
        cuda_round.broadcast(coll, t, 1, rank, stager=_stager())
        got[rank] = t
    run_parties(cluster, name, parties, n * 4, CHUNK_BYTES, None, body)
    for rank in range(parties):
        assert torch.equal(got[rank], torch.arange(n, dtype=torch.float32))


def test_on_caller_stream_leaves_cpu_calls_alone():
    def fn():
        return 1
    assert cuda_region.on_caller_stream(fn, [torch.zeros(1), [(0, b"x")]]) is fn
    assert not cuda.is_cuda(torch.zeros(1)) and not cuda.is_cuda(np.zeros(1)) and not cuda.is_cuda(b"")
