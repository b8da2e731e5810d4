"""A collective's chunk requests on a memory server (``PUSH``, ``PULL`` and ``REDUCE``, formats in
:mod:`smb_protocol.wire`; the client side is ``smb_client/collective.py``).

A chunk has an int64 count word beside it in the same extent. A push waits until the
count reaches the round's base, then under the extent's lock stores its chunk (the
round's first arrival) or adds it, and counts the arrival; the decision and the count
change under one lock, so concurrent pushes of a round never lose a contribution. A
pull waits until the count reaches its target, sends the chunk, then counts the pull
(once per numbered request: a repeat gets the bytes again and counts nothing), so the
chunk may be overwritten once every party pulled it. A ``REDUCE`` is a push (here) and
its pull, which the plane queues and serves when the chunk is complete
(:mod:`.deliveries`). Collectives use regions of their own: replicated extents refuse
them, and so does an extent being moved (NotPrimary: the client retries at the extent's
new place once the move is done, with the same numbers). A push or pull counts as a
mutation served unreplicated (:meth:`.replication.Replication.unreplicated`) once it
stops waiting, so a move's copy starts only after it, or refuses it.
"""
from __future__ import annotations

import struct

from smb_protocol import wire
from smb_protocol.errors import ExtentNotFound, InvalidArgument, Misaligned
from smb_protocol.wire import WaitCond

from . import kernels, ops
from .arena import Extent
from .dedup import Entry
from .kernels import Arith
from .node import Node
from .peer import Peer
from .requests import Pull, Push, Reduce

_OLD = struct.Struct("<q")


def check_chunk(req: Push | Pull, extent: Extent) -> None:
    """The chunk's size and its count word's place."""
    name = req.op.name.lower()
    if req.length > wire.MAX_CHUNK:
        raise InvalidArgument(f"{name} moves at most {wire.MAX_CHUNK} bytes, not {req.length}")
    if req.word % 8:
        raise Misaligned(f"{name}: count word offset {req.word} is not 8-byte aligned")
    extent.check_range(req.word, 8)
    if req.word < req.offset + req.length and req.offset < req.word + 8:
        raise InvalidArgument(f"{name}: count word at {req.word} overlaps the chunk "
                              f"[{req.offset}, {req.offset + req.length})")


def push(node: Node, peer: Peer, extent: Extent, req: Push, entry: Entry | None) -> bytes:
    """Receive the chunk whole, wait until the count reaches ``req.base``, then store or
    add it and count the arrival; answers the count before."""
    check_chunk(req, extent)
    if isinstance(req, Reduce) and not 1 <= req.parties <= wire.MAX_PARTIES:
        raise InvalidArgument(f"reduce: parties must lie in 1..{wire.MAX_PARTIES}, not {req.parties}")
    dt = kernels.check_arith(Arith.ACCUMULATE, req.dtype, req.offset, req.length)
    with extent.pin(), peer.payload(req.length) as src:
        chunk = src.take(req.length) if req.length else memoryview(b"")
        node.waiters.wait(extent, req.word, WaitCond.AT_LEAST, req.base, req.timeout, peer.cancelled)
        with node.replication.unreplicated(extent.extent_id), extent.lock, \
                extent.data[req.offset:req.offset + req.length] as dst, \
                extent.data[req.word:req.word + 8] as count:
            old = kernels.fetch_add(count, 0)
            if old == req.base:
                dst[:] = chunk
            else:
                kernels.apply(Arith.ACCUMULATE, dst, chunk, dt, 0.0)
            # counted after the sum is in place: a pull reads once the count says so,
            # without the lock
            kernels.fetch_add(count, 1)
            if entry is not None:
                entry.applied = max(req.length, 1)
    if not extent.live:
        raise ExtentNotFound(f"extent {extent.extent_id} was released during the push")
    node.waiters.touched(extent.extent_id, req.word, 8)
    peer.stats.add(bytes_accumulated=req.length)
    return _OLD.pack(old)


def pull(node: Node, peer: Peer, req: Pull) -> None:
    """Wait until the count reaches ``req.target``, send the chunk, then count the pull;
    answers through :meth:`~.peer.Peer.send`."""
    extent = peer.tickets.check(node.arena, req.extent_id, write=True)
    extent.check_range(req.offset, req.length)
    check_chunk(req, extent)

    def run(entry: Entry | None) -> None:
        node.waiters.wait(extent, req.word, WaitCond.AT_LEAST, req.target, req.timeout, peer.cancelled)
        with node.replication.unreplicated(extent.extent_id):
            ops.read(peer, extent, req)   # in the socket's buffer once this returns
            with extent.pin(), extent.lock, extent.data[req.word:req.word + 8] as count:
                kernels.fetch_add(count, 1)
    if not req.seq:
        run(None)
    else:
        fresh, _, _ = node.dedup.once(req.client, req.seq, req.what(), peer.dedup_wait, run)
        if not fresh:
            peer.stats.add(repeats=1)
            ops.read(peer, extent, req)
            return None
    node.waiters.touched(req.extent_id, req.word, 8)
    return None
