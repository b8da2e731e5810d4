"""The pure parts of published weights: shards as byte runs (against numpy's own
slicing), spans of few requests, the manifest's layout and encoding, the stamps, and
float conversion chunk by chunk (against torch's where torch is there)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb_client.weights import Manifest, Shard, columns, rows
from smb_client.weights.gather import check_conversion, convert
from smb_client.weights.manifest import ALIGN, buffer_of, complete, writing
from smb_client.weights.shards import shard_runs, shard_shape, spans
from smb_protocol.dtypes import DType
from smb_protocol.errors import DtypeError, InvalidArgument, ProtocolError


def gathered(arr: np.ndarray, runs: list[tuple[int, int]]) -> bytes:
    raw = arr.tobytes()
    return b"".join(raw[o:o + n] for o, n in runs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.data())
def test_shard_runs_are_numpys_slice(shape, data):
    arr = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    parts = data.draw(st.integers(1, 4))
    index = data.draw(st.integers(0, parts - 1))
    shard = Shard(dim, index, parts)
    want = np.array_split(arr, parts, axis=dim)[index]
    assert shard_shape(shape, shard) == want.shape
    runs = shard_runs(shape, 4, shard)
    assert gathered(arr, runs) == np.ascontiguousarray(want).tobytes()
    assert all(n > 0 for _, n in runs)
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs[:-1], runs[1:], strict=True))   # merged when adjacent


def test_row_shards_are_one_run_and_column_shards_one_per_row():
    assert shard_runs((8, 6), 4, rows(1, 2)) == [(4 * 6 * 4, 4 * 6 * 4)]
    assert shard_runs((8, 6), 4, columns(1, 2)) == [(r * 24 + 12, 12) for r in range(8)]
    assert shard_runs((8, 6), 4, None) == [(0, 192)]
    assert shard_runs((8, 6), 4, Shard(1, 0, 1)) == [(0, 192)]


def test_bad_shards_are_refused():
    with pytest.raises(InvalidArgument):
        Shard(0, 2, 2)
    with pytest.raises(InvalidArgument):
        Shard(0, 0, 0)
    with pytest.raises(InvalidArgument):
        shard_runs((4,), 4, Shard(1, 0, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=12), st.integers(0, 30))
def test_spans_cover_every_piece_and_split_at_large_gaps(raw, gap):
    pieces, pos = [], 0
    for skip, n in raw:               # disjoint pieces, in order
        pos += skip
        pieces.append((pos, n))
        pos += n
    out = spans(pieces, gap)
    seen = sorted(i for s in out for _, _, i in s.pieces)
    assert seen == [i for i, (_, n) in enumerate(pieces) if n]
    for s in out:
        assert s.start == s.pieces[0][0] and s.end == s.pieces[-1][0] + s.pieces[-1][1]
        for a, b in zip(s.pieces[:-1], s.pieces[1:], strict=True):
            assert b[0] - (a[0] + a[1]) <= gap
    for a, b in zip(out[:-1], out[1:], strict=True):
        assert b.start - a.end > gap


def test_a_column_shard_of_narrow_rows_is_one_span():
    runs = shard_runs((1024, 256), 4, columns(0, 2))
    assert len(runs) == 1024 and len(spans(runs)) == 1


def test_overlapping_pieces_are_refused():
    with pytest.raises(InvalidArgument):
        spans([(0, 10), (5, 10)])


def test_manifest_layout_and_round_trip():
    m = Manifest.plan({"w": ((3, 5), "float32"), "b": ((5,), "bfloat16"), "n": ((), "int64")}, versions=3)
    assert [t.offset % ALIGN for t in m.tensors] == [0, 0, 0]
    assert m["w"].nbytes == 60 and m["b"].offset == ALIGN and m["n"].offset == 2 * ALIGN
    assert m.slot_bytes == 3 * ALIGN and m.data_bytes == 9 * ALIGN
    assert Manifest.decode(m.encode()) == m
    with pytest.raises(InvalidArgument):
        m["missing"]
    with pytest.raises(InvalidArgument):
        Manifest.plan({"w": ((1,), "float32")}, versions=1)
    with pytest.raises(ProtocolError):
        Manifest.decode(b"{}")


def test_stamps_order_and_buffers():
    assert writing(0) == 1 and complete(0) == 2 and writing(1) > complete(0)
    assert buffer_of([complete(4), writing(5), 0], 4) == 0
    assert buffer_of([complete(4), writing(5), 0], 5) is None


def test_conversions_round_to_nearest_even_and_keep_nan():
    src = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, np.nan, 3.0e38], np.float32)
    out = np.empty(len(src), np.uint16)
    convert(src, DType.FLOAT32, out, DType.BFLOAT16)
    assert out[0] == 0x3F80 and out[1] == 0x3F80 and out[2] == 0x3F82   # ties to even
    back = np.empty(len(src), np.float32)
    convert(out, DType.BFLOAT16, back, DType.FLOAT32)
    assert np.isnan(back[5]) and back[4] == np.inf and back[3] == -2.5
    half = np.empty(len(src), np.float16)
    convert(src[:4], DType.FLOAT32, half[:4], DType.FLOAT16)
    np.testing.assert_array_equal(half[:4], src[:4].astype(np.float16))
    with pytest.raises(DtypeError):
        check_conversion(DType.FLOAT32, DType.INT32, "w")
    check_conversion(DType.INT64, DType.INT64, "n")


def test_bfloat16_conversion_matches_torch():
    torch = pytest.importorskip("torch")
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 1000
    out = np.empty(len(x), np.uint16)
    convert(x.numpy(), DType.FLOAT32, out, DType.BFLOAT16)
    assert np.array_equal(out, x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    half = x.half()
    wide = np.empty(len(x), np.uint16)
    convert(half.numpy(), DType.FLOAT16, wide, DType.BFLOAT16)
    assert np.array_equal(wide, half.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
