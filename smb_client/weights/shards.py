"""Which bytes of a published tensor a reader wants, and how few requests fetch them: pure.

A :class:`Shard` is a tensor-parallel slice: part ``index`` of ``parts`` along ``dim``
(rows of a matrix: ``dim=0``; columns: ``dim=1``), split the way ``numpy.array_split``
splits (the first ``size % parts`` parts one longer). :func:`shard_runs` gives its bytes
as contiguous runs in the order of the shard's own row-major layout; :func:`spans`
groups runs into spans read as one range each, reading through gaps up to ``skip_gap``
bytes (into scratch) rather than sending one request per row.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from smb_protocol.errors import InvalidArgument

log = logging.getLogger(__name__)

#: bytes of a gap between wanted runs that a read goes through rather than around: a
#: request costs about as much as moving this many bytes, so larger gaps split the read
SKIP_GAP = 256 << 10


@dataclass(frozen=True)
class Shard:
    """Part ``index`` (0-based) of ``parts`` along dimension ``dim`` (negative: from the end)."""

    dim: int
    index: int
    parts: int

    def __post_init__(self) -> None:
        for field, value in (("dim", self.dim), ("index", self.index), ("parts", self.parts)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"Shard {field} must be a whole number, not {value!r}")
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise InvalidArgument(f"Shard index {self.index} of {self.parts} parts: need 0 <= index < parts")

    def axis(self, ndim: int) -> int:
        """The dimension as a non-negative index into a shape of ``ndim`` dimensions."""
        d = self.dim + ndim if self.dim < 0 else self.dim
        if not 0 <= d < ndim:
            raise InvalidArgument(f"Shard along dim {self.dim} of a tensor with {ndim} dimensions")
        return d

    def bounds(self, size: int) -> tuple[int, int]:
        """``[start, stop)`` of this part of ``size`` elements."""
        base, extra = divmod(size, self.parts)
        start = self.index * base + min(self.index, extra)
        return start, start + base + (1 if self.index < extra else 0)


def rows(index: int, parts: int) -> Shard:
    """Part ``index`` of ``parts`` along the first dimension (a row-parallel shard)."""
    return Shard(0, index, parts)


def columns(index: int, parts: int) -> Shard:
    """Part ``index`` of ``parts`` along the last dimension (a column-parallel shard)."""
    return Shard(-1, index, parts)


def shard_shape(shape: Sequence[int], shard: Shard | None) -> tuple[int, ...]:
    """The shape of ``shard`` of a tensor of ``shape`` (the whole shape for None)."""
    if shard is None:
        return tuple(shape)
    d = shard.axis(len(shape))
    start, stop = shard.bounds(shape[d])
    return (*shape[:d], stop - start, *shape[d + 1:])


def shard_runs(shape: Sequence[int], itemsize: int, shard: Shard | None) -> list[tuple[int, int]]:
    """``(byte offset in the tensor, bytes)`` of every contiguous run of ``shard``, in the
    shard's row-major order (adjacent runs merged; none for an empty shard)."""
    total = math.prod(shape) * itemsize
    if shard is None:
        return [(0, total)] if total else []
    d = shard.axis(len(shape))
    start, stop = shard.bounds(shape[d])
    inner = math.prod(shape[d + 1:]) * itemsize
    row = shape[d] * inner
    run = (stop - start) * inner
    outer = math.prod(shape[:d])
    if run == 0 or outer == 0:
        return []
    if run == row:
        return [(0, total)]
    return [(o * row + start * inner, run) for o in range(outer)]


@dataclass
class Span:
    """One range ``[start, end)`` read as a whole: the wanted pieces in it, in order,
    as ``(offset, length, index)`` (``index``: the piece's position in the caller's list)."""

    start: int
    end: int
    pieces: list[tuple[int, int, int]]


def spans(pieces: Sequence[tuple[int, int]], skip_gap: int = SKIP_GAP) -> list[Span]:
    """Group ``(offset, length)`` pieces (any order, not overlapping) into spans: pieces
    whose gap is at most ``skip_gap`` bytes share a span."""
    order = sorted((off, n, i) for i, (off, n) in enumerate(pieces) if n > 0)
    out: list[Span] = []
    for off, n, i in order:
        if out and off - out[-1].end <= skip_gap:
            if off < out[-1].end:
                raise InvalidArgument(f"pieces overlap at byte {off}")
            out[-1].end = off + n
            out[-1].pieces.append((off, n, i))
        else:
            out.append(Span(off, off + n, [(off, n, i)]))
    return out
