"""Flat layout of a model's tensors in one region slot (pure: no I/O).

Every tensor gets a range of its own element type (float32, bfloat16 or float16 for
parameters; buffers may also be float64, int32 or int64) that starts on an
:data:`ALIGN`-byte boundary; the gap after it is padding (kept at zero). A *slot* is one copy of all tensors; a
region may hold several slots back to back (gradient slots, one delta slot per
worker). For ``layered`` placement each tensor of each slot is its own segment, so
it lands whole on one memory server.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smb_protocol.errors import DtypeError, InvalidArgument

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ALIGN = 64                  # bytes; every tensor starts on this boundary
ELEMENT_BYTES = 4           # float32
DTYPE = "float32"
PARAM_DTYPES = ("float32", "bfloat16", "float16")       # what a parameter store holds
BUFFER_DTYPES = PARAM_DTYPES + ("float64", "int32", "int64")
DEVICE_TYPES = ("cpu", "cuda")                          # where its tensors may live (CUDA: staged)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int32": 4, "int64": 8}
FLOATING = frozenset({"float32", "bfloat16", "float16", "float64"})
MIN_STRIPE_UNIT = 4096      # bytes
MAX_STRIPE_UNIT = 1 << 20   # bytes
LAYOUT_VERSION = 2          # 1: float32 only, [name, shape]; 2: [name, shape, dtype]


def align_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place inside a slot: ``offset`` and ``padded`` in bytes."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    dtype: str = DTYPE

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (without padding)."""
        return self.numel * self.itemsize

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
    def of(cls, shapes: Iterable[tuple[str, Sequence[int]] | tuple[str, Sequence[int], str]],
           *, allow_empty: bool = False) -> FlatLayout:
        """A layout for ``(name, shape)`` or ``(name, shape, dtype)`` tuples, in order
        (dtype default float32)."""
        out: list[TensorSlot] = []
        offset = 0
        seen: set[str] = set()
        for entry in shapes:
            name, shape = entry[0], entry[1]
            dtype = str(entry[2]) if len(entry) > 2 else DTYPE
            if dtype not in ITEMSIZE:
                raise DtypeError(f"tensor {name!r}: unsupported element type {dtype}")
            if name in seen:
                raise InvalidArgument(f"tensor name {name!r} appears twice")
            seen.add(name)
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise InvalidArgument(f"tensor {name!r} has a negative dimension: {shape}")
            numel = 1
            for d in shape:
                numel *= d
            slot = TensorSlot(name, shape, offset, numel, dtype)
            out.append(slot)
            offset += slot.padded
        if not out and not allow_empty:
            raise InvalidArgument("the model has no parameters to lay out")
        return cls(tuple(out))

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> FlatLayout:
        """The layout of ``module.named_parameters()``: float32, bfloat16 or float16
        tensors (mixed types allowed), all on the CPU or all on one CUDA device."""
        shapes = []
        devices = set()
        for name, p in module.named_parameters():
            check_tensor(name, p)
            devices.add(p.device)
            if len(devices) > 1:
                raise InvalidArgument(f"parameters on {', '.join(sorted(map(str, devices)))}: the parameter "
                                      "store needs them all on one device")
            shapes.append((name, tuple(p.shape), dtype_name(p.dtype)))
        return cls.of(shapes)

    @classmethod
    def of_buffers(cls, module: torch.nn.Module) -> FlatLayout:
        """The layout of ``module.named_buffers()`` (possibly empty)."""
        shapes = []
        for name, b in module.named_buffers():
            dtype = dtype_name(b.dtype)
            if dtype not in BUFFER_DTYPES:
                raise DtypeError(f"buffer {name!r} is {dtype}; the parameter store holds buffers of "
                                 f"{', '.join(BUFFER_DTYPES)}")
            if b.device.type not in DEVICE_TYPES:
                raise InvalidArgument(f"buffer {name!r} is on {b.device}; the parameter store needs CPU or "
                                      "CUDA tensors")
            shapes.append((name, tuple(b.shape), dtype))
        return cls.of(shapes, allow_empty=True)

    # -- sizes --------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every tensor, aligned."""
        if not self.tensors:
            return 0
        last = self.tensors[-1]
        return last.offset + last.padded

    @property
    def slot_elements(self) -> int:
        """float32 elements of one slot (meaningful when every tensor is float32)."""
        return self.slot_bytes // ELEMENT_BYTES

    @property
    def dtypes(self) -> list[str]:
        """The element types present, in order of first appearance."""
        return list(dict.fromkeys(t.dtype for t in self.tensors))

    @property
    def uniform(self) -> str | None:
        """The one element type of every tensor, or None for a mixed layout."""
        kinds = self.dtypes
        return kinds[0] if len(kinds) == 1 else None

    def typed_runs(self, offset: int, length: int) -> list[tuple[int, int, str]]:
        """``[offset, offset+length)`` cut where the element type changes:
        ``(offset, length, dtype)`` pieces (padding belongs to the tensor before it)."""
        out: list[tuple[int, int, str]] = []
        end = offset + length
        for t in self.tensors:
            lo, hi = max(offset, t.offset), min(end, t.offset + t.padded)
            if lo >= hi:
                continue
            if out and out[-1][2] == t.dtype and out[-1][0] + out[-1][1] == lo:
                out[-1] = (out[-1][0], out[-1][1] + hi - lo, t.dtype)
            else:
                out.append((lo, hi - lo, t.dtype))
        return out

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
            if mine.dtype != theirs.dtype:
                raise DtypeError(f"parameter {theirs.name!r} is {theirs.dtype}, {where} holds {mine.dtype}")

    def to_json(self) -> str:
        """The layout as JSON (the store's description keeps it)."""
        return json.dumps({"version": LAYOUT_VERSION, "align": ALIGN,
                           "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors]})

    @classmethod
    def from_json(cls, text: str, *, allow_empty: bool = False) -> FlatLayout:
        """A layout from :meth:`to_json`'s text; InvalidArgument when it is not one."""
        try:
            doc = json.loads(text)
            if doc["version"] == 1 and doc["dtype"] == DTYPE and doc["align"] == ALIGN:
                return cls.of(((name, shape) for name, shape in doc["tensors"]), allow_empty=allow_empty)
            if doc["version"] != LAYOUT_VERSION or doc["align"] != ALIGN:
                raise InvalidArgument(f"unsupported layout {doc['version']}/{doc['align']}")
            return cls.of(((name, shape, dtype) for name, shape, dtype in doc["tensors"]),
                          allow_empty=allow_empty)
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, InvalidArgument):
                raise
            raise InvalidArgument(f"not a parameter-store layout: {exc}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def check_tensor(name: str, t: torch.Tensor) -> None:
    """A float32, bfloat16 or float16 tensor on the CPU or a CUDA device, or a typed
    error saying what is wrong."""
    if dtype_name(t.dtype) not in PARAM_DTYPES:
        raise DtypeError(f"parameter {name!r} is {dtype_name(t.dtype)}; the parameter store holds "
                         "float32, bfloat16 or float16 (convert the model with .float())")
    if t.device.type not in DEVICE_TYPES:
        raise InvalidArgument(f"parameter {name!r} is on {t.device}; the parameter store needs CPU "
                              "or CUDA tensors")
