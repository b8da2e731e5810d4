"""A collective chunk that travels in a wire type (:mod:`smb_protocol.chunk_types`): the
caller's float32 pieces narrowed into one buffer to push (no temporary the size of the
whole buffer: one chunk at a time), and the sum that comes back widened into those
pieces again, or received straight into them when it comes back in full."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smb_protocol.chunk_types import ChunkTypes, narrow, widen
from smb_protocol.dtypes import STORAGE
from smb_protocol.errors import Misaligned

__all__ = ["WireChunk"]


class WireChunk:
    """Chunk ``parts`` (the caller's buffer pieces, of ``types.slot``) as they travel:
    :attr:`sent` holds the pushed bytes, :attr:`into` the buffers a sum is received
    into; :meth:`received` puts a received sum into ``parts``. Borrows ``parts``: they
    must stay valid until the sum is in."""

    __slots__ = ("types", "parts", "sent", "into", "nbytes", "_answer")

    def __init__(self, parts: Sequence[memoryview], types: ChunkTypes) -> None:
        slot, wire = STORAGE[types.slot], STORAGE[types.wire]
        self.types = types
        self.parts = list(parts)
        if any(len(p) % slot.itemsize for p in self.parts):
            raise Misaligned(f"a chunk sent as {types.wire.name.lower()} must be whole "
                             f"{types.slot.name.lower()} elements in every piece")
        n = sum(len(p) for p in self.parts) // slot.itemsize
        pushed = np.empty(n, wire)
        for p, segment in zip(self.parts, self._segments(pushed), strict=True):
            narrow(np.frombuffer(p, slot), types.wire, segment)
        self.sent = [pushed.data.cast("B")]
        self.nbytes = pushed.nbytes
        if types.full:
            self._answer: np.ndarray | None = None
            self.into = self.parts
        else:
            self._answer = np.empty(n, wire)
            self.into = [self._answer.data.cast("B")]

    def _segments(self, arr: np.ndarray) -> list[np.ndarray]:
        """``arr`` cut where the pieces of ``parts`` begin."""
        size, out, pos = STORAGE[self.types.slot].itemsize, [], 0
        for p in self.parts:
            k = len(p) // size
            out.append(arr[pos:pos + k])
            pos += k
        return out

    def received(self) -> None:
        """The sum is in :attr:`into`: widen it into ``parts`` (nothing to do for a full sum)."""
        if self._answer is None:
            return
        slot = STORAGE[self.types.slot]
        for p, segment in zip(self.parts, self._segments(self._answer), strict=True):
            widen(segment, self.types.wire, np.frombuffer(p, slot))
