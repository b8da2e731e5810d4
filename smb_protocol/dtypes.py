"""Element types understood by server-side vector operations.

One byte on the wire names the type. ``bfloat16`` has no numpy type: it is stored as
``uint16`` and widened to float32 for arithmetic, rounding back to nearest-even.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np

from . import _native
from .errors import DtypeError


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT32 = 5
    INT64 = 6


STORAGE: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<u2"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
}
FLOATING = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64})

_NAMES = {
    "float32": DType.FLOAT32, "float": DType.FLOAT32, "f4": DType.FLOAT32,
    "float16": DType.FLOAT16, "half": DType.FLOAT16, "f2": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16,
    "float64": DType.FLOAT64, "double": DType.FLOAT64, "f8": DType.FLOAT64,
    "int32": DType.INT32, "i4": DType.INT32, "int": DType.INT32,
    "int64": DType.INT64, "i8": DType.INT64, "long": DType.INT64,
}


def itemsize(dt: DType) -> int:
    return STORAGE[dt].itemsize


_RESOLVED: dict[Any, DType | None] = {}   # spec -> DType (None: unsupported), for the hot path
_RESOLVED_MAX = 256


def resolve(spec: Any) -> DType:
    """A DType from a name, a numpy dtype, a torch dtype or a DType (DtypeError for
    anything else)."""
    dt = lookup(spec)
    if dt is None:
        return _resolve(spec)   # raises the error that says what is supported
    return dt


def lookup(spec: Any) -> DType | None:
    """:func:`resolve` without the error: None for an unsupported type. Results are
    cached by spec: every operation on a typed buffer looks its type up, and numpy's
    ``dtype.name`` alone costs microseconds."""
    if isinstance(spec, DType):
        return None if spec is DType.NONE else spec
    try:
        hit = _RESOLVED.get(spec, DType.NONE)
    except TypeError:          # unhashable
        hit = DType.NONE
        cache = False
    else:
        cache = True
    if hit is not DType.NONE:
        return hit
    try:
        dt: DType | None = _resolve(spec)
    except DtypeError:
        dt = None
    if cache and len(_RESOLVED) < _RESOLVED_MAX:
        _RESOLVED[spec] = dt
    return dt


def _resolve(spec: Any) -> DType:
    if spec is None:
        raise DtypeError("an element type is required (float32, float16, bfloat16, float64, int32, int64)")
    name = str(spec).removeprefix("torch.")
    if name in _NAMES:
        return _NAMES[name]
    try:
        name = np.dtype(spec).name
    except TypeError:
        pass
    if name in _NAMES:
        return _NAMES[name]
    raise DtypeError(
        f"unsupported element type {spec!r}: expected float32, float16, bfloat16, float64, int32 or int64")


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32."""
    bits = np.ascontiguousarray(raw, dtype=np.uint16)
    out = np.empty(bits.shape, np.float32)
    _native.widen(out, bits, DType.BFLOAT16, False)
    return out


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns (nearest-even; NaN stays NaN)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(values.shape, np.uint16)
    _native.narrow(out, values, DType.BFLOAT16)
    return out
