"""Flat layout of a model's tensors in one region slot (pure: no I/O).

Every tensor gets a float32 range that starts on an :data:`ALIGN`-byte boundary; the
gap after it is padding (kept at zero). A *slot* is one copy of all tensors; a
region may hold several slots back to back (gradient slots, one delta slot per
worker). For ``layered`` placement each tensor of each slot is its own segment, so
it lands whole on one memory server.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DtypeError, InvalidArgument

log = logging.getLogger(__name__)

ALIGN = 64                  # bytes; every tensor starts on this boundary
ELEMENT_BYTES = 4           # float32
DTYPE = "float32"
MIN_STRIPE_UNIT = 4096      # bytes
MAX_STRIPE_UNIT = 1 << 20   # bytes
LAYOUT_VERSION = 1


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place inside a slot: ``offset`` and ``padded`` in bytes."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * ELEMENT_BYTES

    @property
    def padded(self) -> int:
        """Bytes reserved for the tensor: its bytes rounded up to ALIGN (at least ALIGN)."""
        return max(ALIGN, align_up(self.nbytes))


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors ``first..last`` (indices) pushed as one contiguous range."""

    first: int
    last: int
    offset: int   # bytes within a slot
    length: int   # bytes


@dataclass(frozen=True)
class FlatLayout:
    tensors: tuple[TensorSlot, ...]

    # -- construction -------------------------------------------------------------
    @classmethod
    def of(cls, shapes: Iterable[tuple[str, Sequence[int]]]) -> FlatLayout:
        """A layout for ``(name, shape)`` pairs, in order."""
        out: list[TensorSlot] = []
        offset = 0
        seen: set[str] = set()
        for name, shape in shapes:
            if name in seen:
                raise InvalidArgument(f"tensor name {name!r} appears twice")
            seen.add(name)
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise InvalidArgument(f"tensor {name!r} has a negative dimension: {shape}")
            numel = 1
            for d in shape:
                numel *= d
            slot = TensorSlot(name, shape, offset, numel)
            out.append(slot)
            offset += slot.padded
        if not out:
            raise InvalidArgument("the model has no parameters to lay out")
        return cls(tuple(out))

    @classmethod
    def of_module(cls, module: Any) -> FlatLayout:
        """The layout of ``module.named_parameters()``: float32 CPU tensors only."""
        shapes = []
        for name, p in module.named_parameters():
            check_tensor(name, p)
            shapes.append((name, tuple(p.shape)))
        return cls.of(shapes)

    # -- sizes --------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.padded

    @property
    def slot_elements(self) -> int:
        return self.slot_bytes // ELEMENT_BYTES

    @property
    def numel(self) -> int:
        """Elements that hold parameters (padding not counted)."""
        return sum(t.numel for t in self.tensors)

    def segment_sizes(self, slots: int = 1) -> list[int]:
        """Segment sizes (bytes) for ``layered`` placement of ``slots`` slots: one per tensor."""
        if slots < 1:
            raise InvalidArgument(f"need at least one slot, got {slots}")
        return [t.padded for t in self.tensors] * slots

    def stripe_unit(self, servers: int) -> int:
        """A stripe unit (bytes) that spreads one slot over ``servers`` memory servers."""
        share = -(-self.slot_bytes // max(1, servers))
        return min(MAX_STRIPE_UNIT, max(MIN_STRIPE_UNIT, align_up(share, MIN_STRIPE_UNIT)))

    # -- buckets ------------------------------------------------------------------
    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """Consecutive tensors grouped into buckets of about ``bucket_bytes``, from the
        last tensor to the first (the order a backward pass produces gradients)."""
        if bucket_bytes <= 0:
            raise InvalidArgument(f"bucket size must be positive, got {bucket_bytes}")
        out: list[Bucket] = []
        last = len(self.tensors) - 1
        size = 0
        for i in range(len(self.tensors) - 1, -1, -1):
            size += self.tensors[i].padded
            if size >= bucket_bytes or i == 0:
                start = self.tensors[i].offset
                end = self.tensors[last].offset + self.tensors[last].padded
                out.append(Bucket(i, last, start, end - start))
                last, size = i - 1, 0
        return out

    # -- comparison and (de)serialization -----------------------------------------
    def check_same(self, other: FlatLayout, where: str = "the region") -> None:
        """Raise InvalidArgument naming the first difference between two layouts."""
        if len(self.tensors) != len(other.tensors):
            raise InvalidArgument(f"the model has {len(other.tensors)} parameter tensors, {where} "
                                  f"holds {len(self.tensors)}")
        for mine, theirs in zip(self.tensors, other.tensors, strict=True):
            if mine.name != theirs.name or mine.shape != theirs.shape:
                raise InvalidArgument(
                    f"parameter {theirs.name!r} {list(theirs.shape)} does not match {where}'s "
                    f"{mine.name!r} {list(mine.shape)}")

    def to_json(self) -> str:
        return json.dumps({"version": LAYOUT_VERSION, "dtype": DTYPE, "align": ALIGN,
                           "tensors": [[t.name, list(t.shape)] for t in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> FlatLayout:
        try:
            doc = json.loads(text)
            if doc["version"] != LAYOUT_VERSION or doc["dtype"] != DTYPE or doc["align"] != ALIGN:
                raise InvalidArgument(f"unsupported layout {doc['version']}/{doc['dtype']}/{doc['align']}")
            return cls.of((name, shape) for name, shape in doc["tensors"])
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, InvalidArgument):
                raise
            raise InvalidArgument(f"not a parameter-store layout: {exc}") from None


def check_tensor(name: str, t: Any) -> None:
    """A float32 CPU tensor, or a typed error saying what is wrong."""
    if str(t.dtype) != "torch.float32":
        raise DtypeError(f"parameter {name!r} is {str(t.dtype).removeprefix('torch.')}; the parameter "
                         "store holds float32 (convert the model with .float())")
    if t.device.type != "cpu":
        raise InvalidArgument(f"parameter {name!r} is on {t.device}; the parameter store needs CPU "
                              "tensors (train on CPU or copy to a CPU replica)")
