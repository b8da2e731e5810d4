"""Views of caller buffers: bytes, numpy arrays and torch CPU tensors, without copies
(CUDA tensors are staged by :mod:`.cuda` before they get here)."""
from __future__ import annotations

from typing import Any

import numpy as np

from smb_protocol.dtypes import DType, itemsize, lookup, resolve
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned


def _torch_view(t: Any, writable: bool) -> tuple[memoryview, DType]:
    if t.device.type != "cpu":
        raise InvalidArgument(f"tensor on {t.device}: CPU and CUDA tensors can be moved; copy it to one")
    if not t.is_contiguous():
        if writable:
            raise InvalidArgument("read_into needs a contiguous tensor")
        t = t.contiguous()
    dt = resolve(t.dtype)
    import torch  # only reached with a torch tensor in hand
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(raw), dt


def as_view(data: Any, writable: bool = False) -> tuple[memoryview, DType | None]:
    """A flat byte view of ``data`` and its element type (None for raw bytes).

    ``writable`` views (for ``read_into``) must be contiguous: a copy would not reach
    the caller. Read-only uses copy a non-contiguous array once.
    """
    if type(data).__module__.startswith("torch"):
        return _torch_view(data, writable)
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            if writable:
                raise InvalidArgument("read_into needs a C-contiguous array")
            data = np.ascontiguousarray(data)
        if writable and not data.flags.writeable:
            raise InvalidArgument("read_into needs a writable array")
        return memoryview(data.reshape(-1).view(np.uint8)), lookup(data.dtype)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"cannot use {type(data).__name__} as a buffer: pass bytes, bytearray, memoryview, "
            "a numpy array or a torch CPU tensor") from None
    if writable and view.readonly:
        raise InvalidArgument("read_into needs a writable buffer")
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be contiguous")
    return view.cast("B"), None


def typed_view(data: Any, dtype: Any = None, writable: bool = False) -> tuple[memoryview, DType]:
    """:func:`as_view` of ``data`` with its element type: ``dtype``, or the one the buffer
    holds. DtypeError for an untyped buffer without ``dtype`` or one that holds another
    type; Misaligned unless it is a whole number of elements."""
    view, inferred = as_view(data, writable)
    dt = resolve(dtype) if dtype is not None else inferred
    if dt is None:
        raise DtypeError("pass dtype= for untyped buffers (float32, float16, bfloat16, float64, int32, int64)")
    if inferred is not None and inferred != dt:
        raise DtypeError(f"buffer holds {inferred.name.lower()}, dtype {dt.name.lower()} asked for")
    if len(view) % itemsize(dt):
        raise Misaligned(f"{len(view)} bytes is not a whole number of {dt.name.lower()} elements")
    return view, dt
