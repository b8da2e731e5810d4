"""In-place vector operations on extent memory (numpy).

Every function works on byte buffers (memoryviews of extent memory, bytes-like
sources) and an element type from :class:`smb_protocol.dtypes.DType`. Lengths are in
bytes and must be a multiple of the element size (:class:`Misaligned` otherwise).
Callers hold the extent's lock: these functions do no locking of their own.

Arithmetic rules: float32/float64/float16 are computed in their own type (float16
``axpy`` and ``scale`` widen to float32 and round once); bfloat16 is widened to
float32 and rounded back to nearest-even; int32/int64 wrap around. Large ranges are
processed in chunks of :data:`CHUNK_BYTES` so temporaries stay small.
"""
from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable

import numpy as np

from smb_protocol.chunk_types import ChunkTypes, widen
from smb_protocol.dtypes import FLOATING, STORAGE, DType
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned
from smb_protocol.requests import Arith

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20       # bytes processed per step
BF16_BLOCK = 1 << 15        # bfloat16 elements widened at a time (temporaries stay in cache)
WORD = np.dtype("<i8")      # the atomics' word
_F32 = np.dtype(np.float32)
_LOAD = struct.Struct("<q")


def element_type(dtype: int) -> DType:
    """The DType for a wire code; DtypeError for NONE or an unknown code."""
    try:
        dt = DType(dtype)
    except ValueError:
        raise DtypeError(f"unknown element type code {dtype}") from None
    if dt is DType.NONE:
        raise DtypeError("an element type is required (float32, float16, bfloat16, float64, int32, int64)")
    return dt


def _floating(dtype: int, op: str) -> DType:
    dt = element_type(dtype)
    if dt not in FLOATING:
        raise DtypeError(f"{op} needs a floating element type (float32, float16, bfloat16, float64), "
                         f"not {dt.name.lower()}")
    return dt


def check_length(nbytes: int, dt: DType) -> None:
    """Misaligned unless ``nbytes`` is a whole number of elements."""
    size = STORAGE[dt].itemsize
    if nbytes % size:
        raise Misaligned(f"{nbytes} bytes is not a multiple of the {dt.name.lower()} element size "
                         f"({size} bytes)")


def check_arith(op: Arith, dtype: int, offset: int, length: int) -> DType:
    """Validate an arithmetic request as every plane must: a known element type (a
    floating one for axpy and scale), offset and length whole elements. Returns the
    element type; raises DtypeError or Misaligned with what is allowed."""
    dt = element_type(dtype)
    if op is not Arith.ACCUMULATE and dt not in FLOATING:
        raise DtypeError(f"{op.value} needs a floating element type (float32, float16, bfloat16, "
                         f"float64), not {dt.name.lower()}")
    size = STORAGE[dt].itemsize
    if offset % size or length % size:
        raise Misaligned(f"offset {offset} and length {length} must be multiples of the "
                         f"{dt.name.lower()} element size ({size} bytes)")
    return dt


def apply(op: Arith, dst: memoryview, src: memoryview | bytes | bytearray | None, dt: DType,
          alpha: float = 1.0) -> None:
    """Run ``op`` on ``dst`` in place (``src`` is unused by scale). The caller holds the
    extent's lock and validated the request with :func:`check_arith`."""
    if op is Arith.SCALE:
        scale(dst, alpha, dt)
        return
    if src is None:
        raise InvalidArgument(f"{op.value} needs a source buffer")
    if op is Arith.ACCUMULATE:
        accumulate(dst, src, dt)
    else:
        axpy(dst, alpha, src, dt)


def _view(buf: memoryview | bytes | bytearray, dt: DType) -> np.ndarray:
    return np.frombuffer(buf, dtype=STORAGE[dt])


def _apply(dst: memoryview, src: memoryview | bytes | bytearray | None, dt: DType,
           fn: Callable[[np.ndarray, np.ndarray | None], None]) -> None:
    n = len(dst)
    check_length(n, dt)
    if src is not None and len(src) != n:
        raise InvalidArgument(f"source of {len(src)} bytes for a destination of {n} bytes")
    dst = memoryview(dst).cast("B")
    srcv = memoryview(src).cast("B") if src is not None else None
    step = CHUNK_BYTES - CHUNK_BYTES % STORAGE[dt].itemsize
    with np.errstate(all="ignore"):  # float overflow to inf is the arithmetic's business
        if n <= step:   # one step (every collective chunk): no slicing
            fn(_view(dst, dt), _view(srcv, dt) if srcv is not None else None)
            return
        for start in range(0, n, step):
            end = min(n, start + step)
            d = _view(dst[start:end], dt)
            s = _view(srcv[start:end], dt) if srcv is not None else None
            fn(d, s)


class _Scratch(threading.local):
    """Per-thread float32-sized work buffers for the bfloat16 paths."""

    def __init__(self) -> None:
        self.a = np.empty(BF16_BLOCK, np.uint32)
        self.b = np.empty(BF16_BLOCK, np.uint32)
        self.nan = np.empty(BF16_BLOCK, np.bool_)


_scratch = _Scratch()


def _bf16_apply(d: np.ndarray, s: np.ndarray | None,
                fn: Callable[[np.ndarray, np.ndarray | None], None]) -> None:
    """``d = bf16(fn(f32(d), f32(s)))`` block by block, in place, without allocations.

    ``fn(acc, x)`` updates ``acc`` (float32) in place; ``x`` is float32 or None.
    Rounding matches :func:`smb_protocol.dtypes.f32_to_bf16` (nearest-even, NaN -> 0x7FC0).
    """
    sc = _scratch
    for start in range(0, len(d), BF16_BLOCK):
        dd = d[start:start + BF16_BLOCK]
        n = len(dd)
        a, b, nan = sc.a[:n], sc.b[:n], sc.nan[:n]
        np.copyto(a, dd)
        a <<= 16
        acc = a.view(np.float32)
        x = None
        if s is not None:
            np.copyto(b, s[start:start + n])
            b <<= 16
            x = b.view(np.float32)
        fn(acc, x)
        np.not_equal(acc, acc, out=nan)
        np.right_shift(a, 16, out=b)
        b &= 1
        b += 0x7FFF
        b += a
        b >>= 16
        np.copyto(dd, b, casting="unsafe")
        if nan.any():
            dd[nan] = 0x7FC0


def _add(d: np.ndarray, s: np.ndarray | None) -> None:
    assert s is not None
    np.add(d, s, out=d)


def _add_bf16(d: np.ndarray, s: np.ndarray | None) -> None:
    _bf16_apply(d, s, _add)


def accumulate(dst: memoryview, src: memoryview | bytes | bytearray, dtype: int) -> None:
    """``dst += src`` elementwise; both ``len(dst)`` bytes."""
    dt = element_type(dtype)
    _apply(dst, src, dt, _add_bf16 if dt is DType.BFLOAT16 else _add)


def push_chunk(dst: memoryview, src: memoryview, types: ChunkTypes, first: bool) -> None:
    """A collective's push into its slot ``dst``: stored (the round's ``first``) or
    added. A push in a wire type (:mod:`smb_protocol.chunk_types`) is widened into the
    slot's type block by block, so the sum is never rounded to the wire type."""
    if not types.wire:
        if first:
            dst[:] = src
        else:
            accumulate(dst, src, types.slot)
        return
    slot, sent = STORAGE[types.slot], STORAGE[types.wire]
    n = len(src) // sent.itemsize
    if len(dst) != n * slot.itemsize:
        raise InvalidArgument(f"a push of {n} {types.wire.name.lower()} elements into a slot of {len(dst)} bytes")
    d = np.frombuffer(dst, slot)
    s = np.frombuffer(src, sent)
    wide = _scratch.a.view(np.float32)
    with np.errstate(all="ignore"):
        for start in range(0, n, BF16_BLOCK):
            end = min(n, start + BF16_BLOCK)
            if first:
                widen(s[start:end], types.wire, d[start:end])
            else:
                w = wide[:end - start]
                widen(s[start:end], types.wire, w)
                d[start:end] += w


def scale(dst: memoryview, alpha: float, dtype: int) -> None:
    """``dst *= alpha`` elementwise (floating types only)."""
    dt = _floating(dtype, "scale")
    alpha = float(alpha)
    if dt is DType.BFLOAT16:
        def times(acc: np.ndarray, x: np.ndarray | None) -> None:
            np.multiply(acc, np.float32(alpha), out=acc)

        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            _bf16_apply(d, None, times)
    elif dt is DType.FLOAT16:
        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            d[:] = d.astype(_F32) * np.float32(alpha)
    else:
        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            np.multiply(d, alpha, out=d)
    _apply(dst, None, dt, fn)


def axpy(dst: memoryview, alpha: float, x: memoryview | bytes | bytearray, dtype: int) -> None:
    """``dst += alpha * x`` elementwise (floating types only)."""
    dt = _floating(dtype, "axpy")
    alpha = float(alpha)
    if dt is DType.BFLOAT16:
        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            def step(acc: np.ndarray, x: np.ndarray | None) -> None:
                assert x is not None
                x *= np.float32(alpha)
                acc += x
            _bf16_apply(d, s, step)
    elif dt is DType.FLOAT16:
        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            assert s is not None
            acc = s.astype(_F32)
            acc *= np.float32(alpha)
            acc += d
            d[:] = acc
    else:
        def fn(d: np.ndarray, s: np.ndarray | None) -> None:
            assert s is not None
            tmp = np.multiply(s, alpha)
            np.add(d, tmp, out=d)
    _apply(dst, x, dt, fn)


def _wrap64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def load(word_view: memoryview) -> int:
    """The little-endian int64 word, read and never written: a look without the lock
    must not store back what it read (an add under the lock in between would be lost)."""
    if len(word_view) != WORD.itemsize:
        raise Misaligned(f"an atomic word is 8 bytes, got {len(word_view)}")
    return int(_LOAD.unpack(word_view)[0])


def fetch_add(word_view: memoryview, value: int) -> int:
    """Add ``value`` to the little-endian int64 word (wrapping); returns the old value."""
    old = load(word_view)
    _LOAD.pack_into(word_view, 0, _wrap64(old + int(value)))
    return old


def compare_swap(word_view: memoryview, expected: int, desired: int) -> int:
    """Store ``desired`` if the int64 word equals ``expected``; returns the old value."""
    old = load(word_view)
    if old == _wrap64(int(expected)):
        _LOAD.pack_into(word_view, 0, _wrap64(int(desired)))
    return old
