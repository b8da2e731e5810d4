"""In-place vector operations on extent memory.

Every function works on byte buffers (memoryviews of extent memory, bytes-like
sources) and an element type from :class:`smb_protocol.dtypes.DType`. Lengths are in
bytes and must be a multiple of the element size (:class:`Misaligned` otherwise).
Callers hold the extent's lock: these functions do no locking of their own.

The arithmetic is native (``smb_protocol/_native.c``: one pass over the data each, the
interpreter lock released while it runs); this module checks what a request names and
raises the project's typed errors. Rules: float32/float64 are computed in their own
type; float16 and bfloat16 are widened to float32, computed there and rounded once
(nearest-even; a bfloat16 NaN is stored as 0x7FC0); int32/int64 wrap around.
"""
from __future__ import annotations

import logging
import struct

import numpy as np

from smb_protocol import _native
from smb_protocol.dtypes import FLOATING, STORAGE, DType
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned
from smb_protocol.requests import Arith

log = logging.getLogger(__name__)

WORD = np.dtype("<i8")      # the atomics' word
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


def _nbytes(buf: memoryview | bytes | bytearray) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _pair(dst: memoryview, src: memoryview | bytes | bytearray, dt: DType) -> None:
    n = _nbytes(dst)
    check_length(n, dt)
    if _nbytes(src) != n:
        raise InvalidArgument(f"source of {_nbytes(src)} bytes for a destination of {n} bytes")


def accumulate(dst: memoryview, src: memoryview | bytes | bytearray, dtype: int) -> None:
    """``dst += src`` elementwise; both ``len(dst)`` bytes."""
    dt = element_type(dtype)
    _pair(dst, src, dt)
    _native.add(dst, src, dt)


def scale(dst: memoryview, alpha: float, dtype: int) -> None:
    """``dst *= alpha`` elementwise (floating types only)."""
    dt = _floating(dtype, "scale")
    check_length(_nbytes(dst), dt)
    _native.scale(dst, float(alpha), dt)


def axpy(dst: memoryview, alpha: float, x: memoryview | bytes | bytearray, dtype: int) -> None:
    """``dst += alpha * x`` elementwise (floating types only)."""
    dt = _floating(dtype, "axpy")
    _pair(dst, x, dt)
    _native.axpy(dst, float(alpha), x, dt)


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
