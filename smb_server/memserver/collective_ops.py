"""A collective's chunk requests on a memory server (``PUSH``, ``PULL`` and ``REDUCE``, formats in
:mod:`smb_protocol.wire`; the client side is ``smb_client/collective.py``).

A chunk's slot has an int64 count word beside it in the same extent, naming the round
the slot holds and its arrivals; every request names its round, and
:mod:`smb_protocol.rounds` says what each may do. A push waits until the slot's previous
round ended, then under the extent's lock stores its chunk (the round's first arrival)
or adds it, and counts the arrival; the decision and the count change under one lock,
so concurrent pushes of a round never lose a contribution, and a push that fits no round
the slot can take is refused (RoundMismatch), never added. A pull waits until every
push of its round is in, sends the chunk, then counts the pull (once per numbered
request: a repeat gets the bytes again and counts nothing, while the slot still holds
its round), so the chunk may be overwritten once every party pulled it. A pull whose
answer went out is done: nothing after it sends a second answer. A ``REDUCE`` is a push
(here) and its pull, which the plane queues and serves when the chunk is complete
(:mod:`.deliveries`). Collectives use regions of their own: replicated extents refuse
them, and so does an extent being moved (NotPrimary: the client retries at the extent's
new place once the move is done, with the same numbers). A push or pull counts as a
mutation served unreplicated (:meth:`.replication.Replication.unreplicated`) once it
stops waiting, so a move's copy starts only after it, or refuses it.
"""
from __future__ import annotations

import logging
import struct
import time

import numpy as np

from smb_protocol import rounds, wire
from smb_protocol.chunk_types import ChunkTypes, narrow
from smb_protocol.dtypes import STORAGE, itemsize
from smb_protocol.errors import ExtentNotFound, InvalidArgument, Misaligned, SMBError, Status, Timeout
from smb_protocol.requests import Arith, Pull, Push
from smb_protocol.rounds import Step
from smb_protocol.wire import WaitCond

from . import _native, kernels
from .arena import Extent
from .dedup import Entry
from .node import Node
from .peer import Peer

log = logging.getLogger(__name__)

_OLD = struct.Struct("<q")


def chunk_types(req: Push | Pull) -> ChunkTypes | None:
    """The chunk's types (:mod:`smb_protocol.chunk_types`); None for a pull that names
    none (its answer is the slot's bytes as they are)."""
    if isinstance(req, Pull) and not req.dtype:
        return None
    return ChunkTypes.from_code(req.dtype)


def check_chunk(req: Push | Pull, extent: Extent, types: ChunkTypes | None) -> int:
    """The chunk's size and its count word's place; returns the bytes its slot spans."""
    name = req.op.name.lower()
    span = types.slot_bytes(req.length) if types is not None else req.length
    if span > wire.MAX_CHUNK:
        raise InvalidArgument(f"{name} moves at most {wire.MAX_CHUNK} bytes, not {span}")
    extent.check_range(req.offset, span)
    if req.word % 8:
        raise Misaligned(f"{name}: count word offset {req.word} is not 8-byte aligned")
    extent.check_range(req.word, 8)
    if req.word < req.offset + span and req.offset < req.word + 8:
        raise InvalidArgument(f"{name}: count word at {req.word} overlaps the chunk "
                              f"[{req.offset}, {req.offset + span})")
    return span


def push(node: Node, peer: Peer, extent: Extent, req: Push, entry: Entry | None) -> bytes:
    """Receive the chunk whole, wait until its slot's previous round ended, then store or
    add it and count the arrival; answers the count word before."""
    types = ChunkTypes.from_code(req.dtype)
    span = check_chunk(req, extent, types)
    kernels.check_arith(Arith.ACCUMULATE, types.slot, req.offset, span)
    deadline = time.monotonic() + req.timeout
    ref = req.ref
    with extent.pin(), peer.payload(req.length) as src:
        chunk = src.take(req.length) if req.length else memoryview(b"")
        while True:
            with node.replication.unreplicated(extent.extent_id):
                # under the extent's lock, without the interpreter: admitted by the round
                # rules, stored or added, then counted (a pull reads once the count says so)
                step, old, word = _native.push_step(extent.lock, extent.data, req.word, req.offset, chunk,
                                                    types.slot, types.wire or 0, ref.parties, ref.round, ref.root)
                if step < 0:
                    raise rounds.refusal(step, old, ref)
                if step != _native.R_WAIT:
                    if entry is not None:   # finished while counted (see Replication.unreplicated)
                        entry.applied = max(req.length, 1)
                        entry.finish(Status.OK, _OLD.pack(old))
                    break
            _wait(node, peer, extent, req.word, word, deadline, req.timeout)
    if not extent.live:
        raise ExtentNotFound(f"extent {extent.extent_id} was released during the push")
    node.waiters.touched(extent.extent_id, req.word, 8)
    peer.stats.add(bytes_accumulated=req.length)
    if rounds.slot_round(word) == req.ref.round and rounds.arrivals(word) >= req.ref.parties:
        # every sum that waited for this push, sent from here (native/serve.c parks them)
        _native.complete(extent.native, req.word, req.ref.round)
    return _OLD.pack(old)


def _wait(node: Node, peer: Peer, extent: Extent, word: int, value: int, deadline: float,
          timeout: float) -> None:
    """Wait until the count word at ``word`` reaches ``value``; Timeout at ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise absent(extent.extent_id, word, value, timeout)
    node.waiters.wait(extent, word, WaitCond.AT_LEAST, value, left, peer.cancelled)


def absent(extent_id: int, word: int, value: int, timeout: float) -> Timeout:
    """The error of a chunk request whose count word did not reach ``value`` in time."""
    return Timeout(f"the count word at byte {word} of extent {extent_id} did not reach "
                   f"{value:#x} within {timeout:.3g} s: not every party came")


def pull(node: Node, peer: Peer, req: Pull) -> None:
    """Wait until every push of the round is in, send the chunk, then count the pull;
    answers through :meth:`~.peer.Peer.send`, once: a failure after the answer went out
    (the extent released meanwhile) ends the pull quietly."""
    extent = peer.tickets.check(node.arena, req.extent_id, write=True)
    types = chunk_types(req)
    span = check_chunk(req, extent, types)
    deadline = time.monotonic() + req.timeout

    def run(entry: Entry | None) -> None:
        while True:
            word = _word(extent, req.word)
            step, value = rounds.admit_pull(word, req.ref)
            if step is Step.GO:
                break
            _wait(node, peer, extent, req.word, value, deadline, req.timeout)
        with node.replication.unreplicated(extent.extent_id):
            _send_sum(peer, extent, req, types, span)   # in the socket's buffer once this returns
            try:
                with extent.pin():
                    if rounds.arrivals(_native.pull_count(extent.lock, extent.data, req.word)) + 1 \
                            >= 2 * req.ref.parties:
                        extent.narrowed.pop(req.offset, None)   # every party has the round's sum
            except ExtentNotFound:   # released after the sum went out: nothing left to count
                log.debug("extent %d released after a pull was answered", req.extent_id)
            if entry is not None:   # finished while counted (see Replication.unreplicated)
                entry.finish(Status.OK)
    if not req.seq:
        run(None)
    else:
        fresh, _, _ = node.dedup.once(req.client, req.seq, req.what(), peer.dedup_wait, run)
        if not fresh:
            peer.stats.add(repeats=1)
            _send_again(peer, extent, req, types, span)
            return None
    node.waiters.touched(req.extent_id, req.word, 8)
    return None


def ready(node: Node, peer: Peer, req: Pull) -> bool:
    """Whether a pull of ``req`` would stop waiting now: its round has every push in,
    or it would be refused (its extent or ticket went, its round is gone)."""
    try:
        extent = peer.tickets.check(node.arena, req.extent_id, write=True)
        return not extent.live or rounds.admit_pull(_word(extent, req.word), req.ref)[0] is Step.GO
    except SMBError:
        return True


def _word(extent: Extent, offset: int) -> int:
    with extent.pin(), extent.data[offset:offset + 8] as view:
        return kernels.load(view)


def _answer(extent: Extent, req: Pull, view: memoryview, types: ChunkTypes | None) -> memoryview:
    """The sum in the slot (``view``) as a pull answers it: as it is, or narrowed to the
    wire type (rounded once, here, by the round's first pull: every party's pull sends
    the same bytes from :attr:`.extent.Extent.narrowed` until the round ends)."""
    if types is None or types.answer is types.slot:
        return view
    held = extent.narrowed.get(req.offset)
    if held is not None and held[0] == req.ref.round and held[1] == req.dtype:
        return held[2]
    out = np.empty(len(view) // itemsize(types.slot), STORAGE[types.answer])
    narrow(np.frombuffer(view, STORAGE[types.slot]), types.answer, out)
    answer = out.data.cast("B")
    extent.narrowed[req.offset] = (req.ref.round, req.dtype, answer)
    return answer


def _send_sum(peer: Peer, extent: Extent, req: Pull, types: ChunkTypes | None, span: int) -> None:
    """Answer a pull with its round's sum, from the mapping where it travels as it is."""
    with extent.pin(), extent.data[req.offset:req.offset + span] as view:
        out = _answer(extent, req, view, types)
        # counted before the answer goes out, so a client that has it sees the count
        peer.stats.add(bytes_read=len(out), operations=1)
        peer.send(req.req_id, out)


def _send_again(peer: Peer, extent: Extent, req: Pull, types: ChunkTypes | None, span: int) -> None:
    """Answer a repeated pull with the sum again, copied under the extent's lock while the
    slot still holds the pull's round (a later round's push takes the same lock)."""
    with extent.pin(), extent.lock, extent.data[req.word:req.word + 8] as count:
        rounds.check_pulled_again(kernels.load(count), req.ref)
        with extent.data[req.offset:req.offset + span] as view:
            copy = memoryview(bytes(_answer(extent, req, view, types)))
    peer.stats.add(bytes_read=len(copy), operations=1)
    peer.send(req.req_id, copy)
