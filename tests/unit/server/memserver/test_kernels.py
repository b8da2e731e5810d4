"""In-place vector kernels of the memory server."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb_protocol.dtypes import STORAGE, DType, bf16_to_f32, f32_to_bf16
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned
from smb_server.memserver import kernels

NUMERIC = [DType.FLOAT32, DType.FLOAT16, DType.FLOAT64, DType.INT32, DType.INT64]
FLOATS = [DType.FLOAT32, DType.FLOAT16, DType.FLOAT64]


def _buf(values: np.ndarray) -> memoryview:
    """A writable byte view of a copy of ``values`` (as extent memory would be)."""
    return memoryview(bytearray(values.tobytes()))


def _arr(view: memoryview, dt: DType) -> np.ndarray:
    return np.frombuffer(view, dtype=STORAGE[dt])


@pytest.mark.parametrize("dt", NUMERIC)
def test_accumulate_matches_numpy(dt):
    rng = np.random.default_rng(int(dt))
    a = (rng.standard_normal(1000) * 100).astype(STORAGE[dt])
    b = (rng.standard_normal(1000) * 100).astype(STORAGE[dt])
    dst = _buf(a)
    kernels.accumulate(dst, b.tobytes(), dt)
    np.testing.assert_array_equal(_arr(dst, dt), a + b)


def test_accumulate_bfloat16_rounds_to_nearest_even():
    one = 0x3F80                      # 1.0
    tiny = f32_to_bf16(np.array([2.0 ** -8], np.float32))[0]       # half an ulp of 1.0
    three_tiny = f32_to_bf16(np.array([3 * 2.0 ** -8], np.float32))[0]
    dst = _buf(np.array([one, one, 0x4000], np.uint16))           # 1, 1, 2
    src = np.array([tiny, three_tiny, 0x3F80], np.uint16)         # 2^-8, 3*2^-8, 1
    kernels.accumulate(dst, src.tobytes(), DType.BFLOAT16)
    out = _arr(dst, DType.BFLOAT16)
    assert out[0] == 0x3F80          # 1 + half ulp: tie, to even (1.0)
    assert out[1] == 0x3F82          # 1 + 1.5 ulp: tie, to even (1 + 2^-6)
    assert bf16_to_f32(out[2:3])[0] == 3.0


def test_accumulate_bfloat16_matches_float32_reference():
    rng = np.random.default_rng(7)
    a = f32_to_bf16(rng.standard_normal(4096).astype(np.float32))
    b = f32_to_bf16(rng.standard_normal(4096).astype(np.float32))
    dst = _buf(a)
    kernels.accumulate(dst, b.tobytes(), DType.BFLOAT16)
    expect = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))
    np.testing.assert_array_equal(_arr(dst, DType.BFLOAT16), expect)


@pytest.mark.parametrize("dt", [DType.INT32, DType.INT64])
def test_integer_accumulate_wraps(dt):
    info = np.iinfo(STORAGE[dt])
    dst = _buf(np.array([info.max, info.min], STORAGE[dt]))
    kernels.accumulate(dst, np.array([1, -1], STORAGE[dt]).tobytes(), dt)
    assert _arr(dst, dt).tolist() == [info.min, info.max]


def test_memoryviews_of_any_format_are_counted_in_bytes():
    n = 10_001   # odd: the vector loops' tails too
    a = np.arange(n, dtype=np.float32)
    dst = memoryview(a)                     # format "f": len() counts elements, not bytes
    kernels.accumulate(dst, memoryview(np.ones(n, np.float32)), DType.FLOAT32)
    kernels.scale(dst, 2.0, DType.FLOAT32)
    kernels.axpy(dst, -1.0, np.full(n, 2, np.float32).tobytes(), DType.FLOAT32)
    np.testing.assert_array_equal(a, 2 * np.arange(n))
    with pytest.raises(InvalidArgument):
        kernels.accumulate(dst, memoryview(np.ones(n // 2, np.float32)), DType.FLOAT32)


@pytest.mark.parametrize("dt", FLOATS + [DType.BFLOAT16])
def test_scale_and_axpy(dt):
    x = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    y = np.array([4.0, 1.0, -1.0, 0.0], np.float32)
    enc = (lambda v: f32_to_bf16(v)) if dt is DType.BFLOAT16 else (lambda v: v.astype(STORAGE[dt]))
    dec = (lambda v: bf16_to_f32(v)) if dt is DType.BFLOAT16 else (lambda v: v.astype(np.float64))
    dst = _buf(enc(x))
    kernels.scale(dst, -1.5, dt)
    np.testing.assert_array_equal(dec(_arr(dst, dt)), x * -1.5)
    dst = _buf(enc(x))
    kernels.axpy(dst, 0.5, enc(y).tobytes(), dt)
    np.testing.assert_array_equal(dec(_arr(dst, dt)), x + 0.5 * y)


@pytest.mark.parametrize("dt", [DType.INT32, DType.INT64])
def test_scale_and_axpy_refuse_integers(dt):
    dst = _buf(np.zeros(4, STORAGE[dt]))
    with pytest.raises(DtypeError):
        kernels.scale(dst, 2.0, dt)
    with pytest.raises(DtypeError):
        kernels.axpy(dst, 2.0, bytes(len(dst)), dt)


def test_dtype_none_and_unknown():
    dst = _buf(np.zeros(4, np.float32))
    for code in (DType.NONE, 0, 99):
        with pytest.raises(DtypeError):
            kernels.accumulate(dst, bytes(16), code)


def test_misaligned_and_mismatched_lengths():
    with pytest.raises(Misaligned):
        kernels.accumulate(memoryview(bytearray(6)), bytes(6), DType.FLOAT32)
    with pytest.raises(Misaligned):
        kernels.scale(memoryview(bytearray(12)), 1.0, DType.FLOAT64)
    with pytest.raises(InvalidArgument):
        kernels.accumulate(memoryview(bytearray(8)), bytes(4), DType.FLOAT32)


def test_float16_overflow_is_inf_without_warnings(recwarn):
    dst = _buf(np.array([60000.0], np.float16))
    kernels.accumulate(dst, np.array([60000.0], np.float16).tobytes(), DType.FLOAT16)
    assert np.isinf(_arr(dst, DType.FLOAT16)[0])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_fetch_add_and_compare_swap():
    word = memoryview(bytearray(8))
    assert kernels.fetch_add(word, 5) == 0
    assert kernels.fetch_add(word, -7) == 5
    assert int.from_bytes(word, "little", signed=True) == -2
    assert kernels.compare_swap(word, 3, 9) == -2           # no match: unchanged
    assert kernels.compare_swap(word, -2, 9) == -2          # match: swapped
    assert kernels.fetch_add(word, 0) == 9
    word[:] = (2 ** 63 - 1).to_bytes(8, "little")
    assert kernels.fetch_add(word, 1) == 2 ** 63 - 1
    assert int.from_bytes(word, "little", signed=True) == -2 ** 63   # wraps
    with pytest.raises(Misaligned):
        kernels.fetch_add(memoryview(bytearray(4)), 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(-2 ** 63, 2 ** 63 - 1), st.integers(-2 ** 63, 2 ** 63 - 1)),
                min_size=1, max_size=64))
def test_int64_accumulate_property(pairs):
    a = np.array([p[0] for p in pairs], np.int64)
    b = np.array([p[1] for p in pairs], np.int64)
    dst = _buf(a)
    kernels.accumulate(dst, b.tobytes(), DType.INT64)
    wrap = [((x + y + 2 ** 63) % 2 ** 64) - 2 ** 63 for x, y in pairs]
    assert _arr(dst, DType.INT64).tolist() == wrap


def test_bfloat16_paths_match_the_reference():
    rng = np.random.default_rng(11)
    n = 100_003
    a = f32_to_bf16((rng.standard_normal(n) * 1e3).astype(np.float32))
    b = f32_to_bf16((rng.standard_normal(n) * 1e3).astype(np.float32))
    a[5], b[6], a[7], b[7] = 0x7FC0, 0x7F80, 0x7F80, 0xFF80     # nan, inf, inf + -inf
    a[8] = b[8] = 0x7F7F                                         # max + max overflows to inf
    with np.errstate(all="ignore"):
        ref = {
            "accumulate": f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)),
            "scale": f32_to_bf16(bf16_to_f32(a) * np.float32(0.3)),
            "axpy": f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b) * np.float32(-0.7)),
        }
    got = {}
    dst = _buf(a)
    kernels.accumulate(dst, b.tobytes(), DType.BFLOAT16)
    got["accumulate"] = _arr(dst, DType.BFLOAT16)
    dst = _buf(a)
    kernels.scale(dst, 0.3, DType.BFLOAT16)
    got["scale"] = _arr(dst, DType.BFLOAT16)
    dst = _buf(a)
    kernels.axpy(dst, -0.7, b.tobytes(), DType.BFLOAT16)
    got["axpy"] = _arr(dst, DType.BFLOAT16)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    assert got["accumulate"][5] == 0x7FC0 and got["accumulate"][7] == 0x7FC0
    assert got["accumulate"][8] == 0x7F80


def test_check_arith_is_the_one_rule_for_every_plane():
    assert kernels.check_arith(kernels.Arith.ACCUMULATE, DType.INT32, 8, 16) is DType.INT32
    assert kernels.check_arith(kernels.Arith.SCALE, DType.BFLOAT16, 2, 6) is DType.BFLOAT16
    with pytest.raises(DtypeError, match="axpy needs a floating element type"):
        kernels.check_arith(kernels.Arith.AXPY, DType.INT64, 0, 8)
    with pytest.raises(Misaligned, match="multiples of the float32 element size"):
        kernels.check_arith(kernels.Arith.ACCUMULATE, DType.FLOAT32, 2, 8)
    with pytest.raises(DtypeError):
        kernels.check_arith(kernels.Arith.ACCUMULATE, DType.NONE, 0, 8)


def test_apply_dispatches_each_operation():
    dst = np.arange(8, dtype=np.float32)
    src = np.ones(8, dtype=np.float32)
    kernels.apply(kernels.Arith.ACCUMULATE, memoryview(dst).cast("B"), memoryview(src).cast("B"), DType.FLOAT32)
    np.testing.assert_array_equal(dst, np.arange(8) + 1)
    kernels.apply(kernels.Arith.AXPY, memoryview(dst).cast("B"), memoryview(src).cast("B"), DType.FLOAT32, 2.0)
    np.testing.assert_array_equal(dst, np.arange(8) + 3)
    kernels.apply(kernels.Arith.SCALE, memoryview(dst).cast("B"), None, DType.FLOAT32, 0.5)
    np.testing.assert_array_equal(dst, (np.arange(8) + 3) / 2)
    with pytest.raises(InvalidArgument):
        kernels.apply(kernels.Arith.ACCUMULATE, memoryview(dst).cast("B"), None, DType.FLOAT32)
