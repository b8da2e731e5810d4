"""The element types of a collective's chunk requests (``PUSH``, ``PULL``, ``REDUCE``):
what a chunk's slot sums in, what a push carries, what a pull answers.

A collective sums each chunk in the element type of its parties' buffers, the *slot*
type. With a *wire* type (bfloat16 or float16, for float32 slots) every push carries
the chunk in the narrower type and the memory server widens it into the float32 sum, so
no push is rounded and half the bytes travel; the sum goes back in the wire type,
rounded once by the server, or, with ``full``, in the slot's own type (twice the bytes
of the wire type, never rounded).

On the wire a chunk request's dtype byte holds the slot type in bits 0-3, the wire type
in bits 4-6 (0: none, the slot type travels) and ``full`` in bit 7; a byte with only the
low bits set is today's plain chunk request. A request's ``length`` is the chunk's
bytes on the wire, the pushed payload: the slot spans :meth:`ChunkTypes.slot_bytes` of
it and a pull answers :meth:`ChunkTypes.answer_bytes`. The conversions live here, so
that client and server round alike (:func:`narrow`: nearest-even, NaN stays NaN;
:func:`widen` is exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _native
from .dtypes import STORAGE, DType, itemsize, resolve
from .errors import DtypeError, Misaligned

__all__ = ["ChunkTypes", "WIRE_TYPES", "wire_type", "narrow", "widen"]

#: slot type -> the wire types it may travel as
WIRE_TYPES: dict[DType, frozenset[DType]] = {DType.FLOAT32: frozenset({DType.BFLOAT16, DType.FLOAT16})}

_WIRE_SHIFT = 4
_FULL = 0x80


def wire_type(spec: Any) -> DType:
    """The wire type a caller names (``"bf16"``, ``"bfloat16"``, ``"fp16"``,
    ``"float16"``, a numpy or torch dtype, a DType); None means none (DType.NONE)."""
    if spec is None:
        return DType.NONE
    if isinstance(spec, str) and spec.lower() == "fp16":
        return DType.FLOAT16
    return resolve(spec)


_DECODED: dict[int, ChunkTypes] = {}   # dtype byte -> its types, for the bytes seen


@dataclass(frozen=True, slots=True)
class ChunkTypes:
    """A chunk request's types: the ``slot`` it sums in, the ``wire`` type its pushes
    carry (NONE: the slot's), and whether pulls answer in the slot type (``full``)."""

    slot: DType
    wire: DType = DType.NONE
    full: bool = False

    def __post_init__(self) -> None:
        if self.slot not in STORAGE:
            raise DtypeError(f"a collective's chunks hold a known element type, not {self.slot!r}")
        if self.wire is not DType.NONE and self.wire not in WIRE_TYPES.get(self.slot, ()):
            allowed = ", ".join(sorted(t.name.lower() for t in WIRE_TYPES.get(self.slot, ())))
            raise DtypeError(f"{self.slot.name.lower()} chunks cannot travel as {self.wire.name.lower()}"
                             + (f" (they may as {allowed})" if allowed else " (they travel as they are)"))
        if self.full and self.wire is DType.NONE:
            raise DtypeError("full sums come back only from chunks pushed in a wire type")

    @property
    def sent(self) -> DType:
        """What a push carries."""
        return self.wire or self.slot

    @property
    def answer(self) -> DType:
        """What a pull answers."""
        return self.slot if self.full or not self.wire else self.wire

    def code(self) -> int:
        """The request's dtype byte."""
        return int(self.slot) | int(self.wire) << _WIRE_SHIFT | (_FULL if self.full else 0)

    @classmethod
    def from_code(cls, code: int) -> ChunkTypes:
        """The types a request's dtype byte names; DtypeError for a byte that names none.
        (Every chunk request decodes one: the few valid bytes are decoded once.)"""
        known = _DECODED.get(code)
        if known is not None:
            return known
        try:
            types = cls(DType(code & 0x0F), DType(code >> _WIRE_SHIFT & 0x07), bool(code & _FULL))
        except ValueError:
            raise DtypeError(f"dtype byte {code:#04x} names no element types of a collective's chunk") from None
        _DECODED[code] = types
        return types

    def _elements(self, wire_bytes: int) -> int:
        size = itemsize(self.sent)
        if wire_bytes % size:
            raise Misaligned(f"{wire_bytes} bytes are not whole {self.sent.name.lower()} elements")
        return wire_bytes // size

    def slot_bytes(self, wire_bytes: int) -> int:
        """The slot bytes a chunk of ``wire_bytes`` pushed bytes spans."""
        return self._elements(wire_bytes) * itemsize(self.slot)

    def answer_bytes(self, wire_bytes: int) -> int:
        """The bytes a pull of that chunk answers."""
        return self._elements(wire_bytes) * itemsize(self.answer)

    def wire_bytes(self, slot_bytes: int) -> int:
        """The pushed bytes of a chunk whose slot spans ``slot_bytes``."""
        size = itemsize(self.slot)
        if slot_bytes % size:
            raise Misaligned(f"{slot_bytes} bytes are not whole {self.slot.name.lower()} elements")
        return slot_bytes // size * itemsize(self.sent)


def narrow(values: np.ndarray, wire: DType, out: np.ndarray) -> None:
    """Round float32 ``values`` into ``out`` (the wire type's storage: uint16 bit
    patterns for bfloat16, float16), nearest-even; NaN stays NaN (one native pass,
    ``smb_protocol/_native.c``)."""
    _native.narrow(out, values, _wire(wire))


def widen(raw: np.ndarray, wire: DType, out: np.ndarray) -> None:
    """Widen the wire type's elements ``raw`` into float32 ``out`` (exact)."""
    _native.widen(out, raw, _wire(wire), False)


def _wire(wire: DType) -> DType:
    if wire is not DType.BFLOAT16 and wire is not DType.FLOAT16:
        raise DtypeError(f"no 16-bit wire type {wire.name.lower()}")
    return wire
