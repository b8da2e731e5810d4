"""The native elementwise kernels (smb_protocol/_native.c) against references computed
here another way: numpy's own float16 arithmetic and casts, torch's bfloat16 rounding,
and bfloat16 rounded with integer arithmetic on the bit patterns. Every float16 case
runs with the CPU's F16C conversions and with the portable ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from smb_protocol import _native
from smb_protocol.dtypes import DType

EDGES = np.array([
    0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,   # zeros, infs, NaNs
    0x477FF000, 0x477FEFFF, 0x477FE000, 0x477FF001,            # around the largest float16 (65504)
    0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000,            # around half the smallest subnormal
    0x38800000, 0x387FFFFF, 0x38000000, 0x37FFFFFF, 0x38801000,  # around the smallest normal
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F800FFF, 0x3F801000, 0x3F803000,  # ties to even
    0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x807FFFFF,            # float32's extremes
], np.uint32)


@pytest.fixture(params=[True, False], ids=["f16c", "portable"])
def f16c(request):
    before = _native.f16c(request.param)
    if request.param and not _native.f16c():
        pytest.skip("this CPU has no F16C instructions")
    yield request.param
    _native.f16c(before)


def _float32_patterns(n: int = 1 << 18) -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.concatenate([rng.integers(0, 2 ** 32, n, dtype=np.uint32), EDGES]).view(np.float32)


def _bf16_reference(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, nearest-even, NaN as 0x7FC0, in integers."""
    bits = values.view(np.uint32).astype(np.uint64)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out


def _widen_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    if got.dtype.kind == "f":
        nan = np.isnan(got)
        np.testing.assert_array_equal(nan, np.isnan(want))
        got, want = got[~nan], want[~nan]
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_bfloat16_narrowing_matches_torch_and_the_integer_rule():
    x = _float32_patterns()
    out = np.empty(len(x), np.uint16)
    _native.narrow(out, x, DType.BFLOAT16)
    np.testing.assert_array_equal(out, _bf16_reference(x))
    ours = out[~np.isnan(x)]
    theirs = torch.from_numpy(x[~np.isnan(x)]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_float16_narrowing_matches_numpys_cast(f16c):
    x = _float32_patterns()
    out = np.empty(len(x), np.float16)
    _native.narrow(out, x, DType.FLOAT16)
    with np.errstate(over="ignore"):
        _same(out, x.astype(np.float16))


@pytest.mark.parametrize("wire", [DType.BFLOAT16, DType.FLOAT16])
def test_widening_every_16_bit_pattern_is_exact(wire, f16c):
    raw = np.arange(1 << 16, dtype=np.uint16)
    want = _widen_bf16(raw) if wire is DType.BFLOAT16 else raw.view(np.float16).astype(np.float32)
    out = np.empty(len(raw), np.float32)
    _native.widen(out, raw, wire, False)
    _same(out, want)
    acc = np.full(len(raw), 0.25, np.float32)
    _native.widen(acc, raw, wire, True)
    with np.errstate(invalid="ignore", over="ignore"):
        _same(acc, np.float32(0.25) + want)


def _operands(dt: DType, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if dt in (DType.INT32, DType.INT64):
        info = np.iinfo(f"i{4 if dt is DType.INT32 else 8}")
        return tuple(rng.integers(info.min, info.max, n, dtype=info.dtype, endpoint=True) for _ in range(2))
    if dt is DType.BFLOAT16:
        return tuple(rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(2))
    if dt is DType.FLOAT16:   # every pattern, NaNs and infinities included
        return tuple(rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.float16) for _ in range(2))
    kind = np.float32 if dt is DType.FLOAT32 else np.float64
    return tuple((rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(kind) for _ in range(2))


def _reference(op: str, dt: DType, d: np.ndarray, s: np.ndarray, alpha: float) -> np.ndarray:
    """The operation computed with numpy: in the type itself (float32, float64, ints,
    float16 sums as numpy's float16 does them), or in float32 and rounded once."""
    with np.errstate(all="ignore"):
        if dt is DType.BFLOAT16:
            wide, x = _widen_bf16(d), _widen_bf16(s)
            a = np.float32(alpha)
            r = wide + x if op == "add" else wide + a * x if op == "axpy" else wide * a
            return _bf16_reference(r.astype(np.float32))
        if dt is DType.FLOAT16 and op != "add":
            a = np.float32(alpha)
            wide, x = d.astype(np.float32), s.astype(np.float32)
            return (wide + a * x if op == "axpy" else wide * a).astype(np.float16)
        if op == "add":
            return d + s
        a = d.dtype.type(alpha)
        return d + a * s if op == "axpy" else d * a


ARITHMETIC = [(op, dt) for op in ("add", "axpy", "scale") for dt in list(DType)[1:]
              if op == "add" or dt not in (DType.INT32, DType.INT64)]   # integers are only added


def _conversions(dt: DType) -> list[bool]:
    """The F16C settings to run ``dt`` with: both for float16 (where the CPU has F16C),
    the default for the rest."""
    if dt is not DType.FLOAT16:
        return [_native.f16c()]
    before = _native.f16c(True)
    settings = [True, False] if _native.f16c(before) else [False]
    return settings


@pytest.mark.parametrize("op,dt", ARITHMETIC, ids=lambda v: getattr(v, "name", v).lower())
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 4099])     # the vector loops' tails
def test_arithmetic_matches_the_reference(op, dt, n):
    d, s = _operands(dt, n, seed=n)
    alpha = -0.37 if op == "axpy" else 1.7
    want = _reference(op, dt, d, s, alpha)
    for setting in _conversions(dt):
        before = _native.f16c(setting)
        try:
            got = d.copy()
            if op == "add":
                _native.add(got, s, dt)
            elif op == "axpy":
                _native.axpy(got, alpha, s, dt)
            else:
                _native.scale(got, alpha, dt)
        finally:
            _native.f16c(before)
        if dt is DType.BFLOAT16:
            np.testing.assert_array_equal(got, want)
        else:
            _same(got, want)


def test_integers_wrap_and_are_exact():
    big = np.array([2 ** 63 - 1, -2 ** 63, 12345678901234567], np.int64)
    got = big.copy()
    _native.add(got, np.array([1, -1, 98765432109876543], np.int64), DType.INT64)
    assert got.tolist() == [-2 ** 63, 2 ** 63 - 1, 12345678901234567 + 98765432109876543]


def test_misuse_is_a_value_error_and_changes_nothing():
    d = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        _native.add(d[:4], d[2:6], DType.FLOAT32)
    with pytest.raises(ValueError, match="elements"):
        _native.add(d, np.ones(4, np.float32), DType.FLOAT32)
    with pytest.raises(ValueError, match="not whole elements"):
        _native.add(memoryview(bytearray(6)), bytes(6), DType.FLOAT32)
    with pytest.raises(ValueError, match="no such floating element type"):
        _native.scale(np.ones(2, np.int64), 2.0, DType.INT64)
    with pytest.raises(ValueError, match="wire type"):
        _native.narrow(np.empty(8, np.uint16), d, DType.FLOAT64)
    with pytest.raises(TypeError):
        _native.add(bytes(32), d, DType.FLOAT32)              # a read-only destination
    with pytest.raises(TypeError):
        _native.add(np.ones((4, 4), np.float32)[:, 0], np.ones(4, np.float32), DType.FLOAT32)  # strided
    np.testing.assert_array_equal(d, np.ones(8, np.float32))
