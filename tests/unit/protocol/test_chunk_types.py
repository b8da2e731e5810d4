"""The element types of a collective's chunk requests: the dtype byte, the byte counts,
and the conversions client and server share (smb_protocol/chunk_types.py)."""
from __future__ import annotations

import numpy as np
import pytest

from smb_protocol.chunk_types import ChunkTypes, narrow, widen, wire_type
from smb_protocol.dtypes import DType, f32_to_bf16
from smb_protocol.errors import DtypeError, Misaligned


def test_a_plain_chunk_keeps_todays_dtype_byte():
    for dt in (DType.FLOAT32, DType.INT64, DType.BFLOAT16):
        assert ChunkTypes(dt).code() == int(dt)
        assert ChunkTypes.from_code(int(dt)) == ChunkTypes(dt)


@pytest.mark.parametrize("wire", [DType.BFLOAT16, DType.FLOAT16])
@pytest.mark.parametrize("full", [False, True])
def test_codes_round_trip_and_bytes_follow_the_types(wire, full):
    t = ChunkTypes(DType.FLOAT32, wire, full)
    assert ChunkTypes.from_code(t.code()) == t
    assert t.sent is wire and t.answer is (DType.FLOAT32 if full else wire)
    assert t.slot_bytes(2000) == 4000 and t.wire_bytes(4000) == 2000
    assert t.answer_bytes(2000) == (4000 if full else 2000)
    with pytest.raises(Misaligned):
        t.slot_bytes(3)


def test_bad_types_are_refused_with_what_is_allowed():
    with pytest.raises(DtypeError, match="int64 chunks cannot travel as bfloat16.*travel as they are"):
        ChunkTypes(DType.INT64, DType.BFLOAT16)
    with pytest.raises(DtypeError, match="may as bfloat16, float16"):
        ChunkTypes(DType.FLOAT32, DType.FLOAT64)
    with pytest.raises(DtypeError, match="full sums"):
        ChunkTypes(DType.FLOAT32, full=True)
    with pytest.raises(DtypeError, match="names no element types"):
        ChunkTypes.from_code(0x0F)
    with pytest.raises(DtypeError):
        ChunkTypes.from_code(0)


def test_wire_names():
    assert wire_type(None) is DType.NONE
    assert wire_type("bf16") is wire_type("bfloat16") is DType.BFLOAT16
    assert wire_type("fp16") is wire_type(np.float16) is DType.FLOAT16


def test_narrowing_rounds_to_nearest_even_and_widening_is_exact():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 1e3,
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1e-40], np.float32)])
    bf = np.empty(len(x), np.uint16)
    narrow(x, DType.BFLOAT16, bf)
    np.testing.assert_array_equal(bf, f32_to_bf16(x))
    back = np.empty(len(x), np.float32)
    widen(bf, DType.BFLOAT16, back)
    again = np.empty(len(x), np.uint16)
    narrow(back, DType.BFLOAT16, again)
    np.testing.assert_array_equal(again, bf)                      # widening loses nothing
    finite = np.isfinite(x) & (np.abs(x) < 3e38)
    assert np.all(np.abs(back[finite] - x[finite]) <= np.abs(x[finite]) * 2.0 ** -8 + 1e-38)
    h = np.empty(len(x), np.float16)
    narrow(x, DType.FLOAT16, h)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h, x.astype(np.float16))
    widen(h, DType.FLOAT16, back)
    np.testing.assert_array_equal(back, h.astype(np.float32))
