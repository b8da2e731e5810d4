"""The operations on extent memory that every path shares: read, plain write,
arithmetic, atomics, and the one receive-and-apply loop (:func:`apply_stream`) that
the plain, the primary's and the backup's mutations all run over a peer's payload."""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeVar

from smb_protocol.dtypes import DType
from smb_protocol.errors import ExtentNotFound, InvalidArgument, Misaligned
from smb_protocol.requests import Arith, Arithmetic, CompareSwap, FetchAdd, Request, Write

from . import kernels
from .arena import Extent
from .dedup import Entry
from .peer import Peer

STEP = 4 << 20   # bytes applied per hold of an extent's lock when there is no payload (SCALE)
_OLD = struct.Struct("<q")
T = TypeVar("T")


def read(peer: Peer, extent: Extent, req: Request) -> None:
    """Answer with the range's bytes, sent from the mapping."""
    with extent.pin(), extent.data[req.offset:req.offset + req.length] as view:
        # counted before the answer goes out, so a client that has it sees the count
        peer.stats.add(bytes_read=req.length, operations=1)
        peer.send(req.req_id, view)


def write(peer: Peer, extent: Extent, req: Write) -> bytes:
    """A plain write: the payload goes straight into the mapping."""
    with extent.pin():
        with extent.data[req.offset:req.offset + req.length] as view, peer.payload(req.length) as src:
            src.into(view)
        if not extent.live:
            raise ExtentNotFound(f"extent {extent.extent_id} was released during the write")
    peer.stats.add(bytes_written=req.length)
    return b""


def arithmetic(peer: Peer, extent: Extent, req: Arithmetic, entry: Entry | None) -> bytes:
    """ACCUMULATE, AXPY or SCALE, chunk by chunk under the extent's lock; a resumed
    attempt skips the bytes that took effect before (``entry.applied``)."""
    dt = kernels.check_arith(req.arith, req.dtype, req.offset, req.length)

    def applied(_: None, first: int, end: int, chunk: memoryview | None) -> None:
        if entry is not None:
            entry.applied = max(end, 1)
    with extent.pin():
        apply_stream(peer, extent, req, dt, entry.applied if entry is not None else 0, after=applied)
        if not extent.live:
            raise ExtentNotFound(f"extent {extent.extent_id} was released during the operation")
    if req.arith is not Arith.SCALE:
        peer.stats.add(bytes_accumulated=req.length)
    return b""


def atomic_locked(extent: Extent, req: FetchAdd | CompareSwap) -> bytes:
    """FETCH_ADD or COMPARE_SWAP on its word (the caller holds the extent's lock)."""
    with extent.data[req.offset:req.offset + 8] as word:
        if isinstance(req, FetchAdd):
            old = kernels.fetch_add(word, req.value)
        else:
            old = kernels.compare_swap(word, req.expected, req.desired)
    return _OLD.pack(old)


def apply_stream(peer: Peer, extent: Extent, req: Write | Arithmetic,
                 dt: DType | None, skip: int = 0,
                 guard: Callable[[], T] | None = None,
                 after: Callable[[T | None, int, int, memoryview | None], None] | None = None) -> None:
    """Apply ``req`` (a write or arithmetic) to ``extent`` chunk by chunk, each chunk
    under the extent's lock: receive its payload (when it has one) from the peer,
    skip the first ``skip`` bytes (received and dropped: an earlier attempt applied
    them), store or compute the rest. Under the same hold of the lock ``guard()``
    runs first (it may refuse by raising) and ``after(guarded, first, end, chunk)``
    last, with the request-relative range applied and its operand bytes."""
    arith = req.arith if isinstance(req, Arithmetic) else None
    carries = arith is not Arith.SCALE
    alpha = req.alpha if isinstance(req, Arithmetic) else 0.0
    base = req.offset
    with peer.payload(req.length if carries else 0) as src:
        step = src.step if carries else STEP
        pos, end = 0, req.length
        while pos < end:
            n = min(end - pos, step)
            chunk = src.take(n) if carries else None
            first = max(pos, skip)
            if first < pos + n:
                part = chunk[first - pos:] if chunk is not None else None
                with extent.lock:
                    guarded = guard() if guard is not None else None
                    with extent.data[base + first:base + pos + n] as dst:
                        if arith is None:
                            assert part is not None
                            dst[:] = part
                        else:
                            assert dt is not None
                            kernels.apply(arith, dst, part, dt, alpha)
                    if after is not None:
                        after(guarded, first, pos + n, part)
            pos += n


def check_word(req: Request) -> None:
    """An operation on one 8-byte word: the length and alignment."""
    name = req.op.name.lower()
    if req.length != 8:
        raise InvalidArgument(f"{name} works on one 8-byte word, not {req.length} bytes")
    if req.offset % 8:
        raise Misaligned(f"{name} needs an 8-byte aligned offset, not {req.offset}")
