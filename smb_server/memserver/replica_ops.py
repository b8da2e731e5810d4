"""The request paths of replicated extents (configuration and forwarding:
:mod:`.replication`).

A primary (:func:`mutate`): a client's mutation is received into scratch (writes too,
so that they are ordered with the rest), applied and forwarded piece by piece under
the extent's lock, then answered once no backup is marked failed. Bytes an earlier
attempt applied (``entry.applied``) are neither applied nor forwarded again: every
backup in the set got them when they were applied (or was marked failed, and is
dropped), and a copy that joined later was filled from this one, which holds them, so
forwarding them again would apply them twice there (its exactly-once table never saw
the request). A client's mutation of a backup is refused (NotPrimary).

A backup (:func:`piece`): a mutation on a connection that presented a ``replica``
ticket for its extent is a piece its primary forwarded, filed under the client request
it belongs to (:func:`piece_what`): its bytes up to ``entry.applied`` are skipped, the
rest applied; the entry is finished once the whole request is in. A piece that starts
after a fresh entry's first byte belongs to a request that began before this backup
joined (its copy brings the start); a gap in a started one is refused. :func:`seed`
takes the exactly-once entries a primary hands a copy it filled.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from smb_protocol.errors import ExtentNotFound, InvalidArgument, NotPrimary, Status, Timeout
from smb_protocol.replicas import ReplicaRole
from smb_protocol.requests import Arithmetic, CompareSwap, FetchAdd, Lock, LockPiece, Request, Seed, Write
from smb_protocol.wire import Op

from . import coord_ops, kernels, ops
from .arena import Extent
from .dedup import Entry, unpack_records
from .node import Node
from .peer import Peer
from .replication import RANGED_OPS, REPLICATED_OPS, Deposed, ReplicaConfig

log = logging.getLogger(__name__)


def primary(node: Node, extent: Extent) -> ReplicaConfig:
    """The extent's configuration, read under its lock; NotPrimary (:class:`Deposed`)
    unless it is a primary."""
    cfg = node.replication.config(extent.extent_id)
    if cfg is None or cfg.role is not ReplicaRole.PRIMARY:
        role = cfg.role if cfg is not None and cfg.role else "not replicated"
        raise Deposed(f"extent {extent.extent_id} is {role} here, not a primary: open the "
                      "region again and send mutations to its primary")
    return cfg


# -- a primary's path -------------------------------------------------------------------------
def mutate(node: Node, peer: Peer, extent: Extent, req: Request, entry: Entry | None) -> bytes:
    """A client's mutation of a replicated extent (access already checked)."""
    if node.replication.role(extent.extent_id) is not ReplicaRole.PRIMARY:
        primary(node, extent)   # raises NotPrimary
    if req.op not in REPLICATED_OPS:   # a collective's chunk while its extent is moved: retried after
        raise NotPrimary(f"{req.op.name.lower()} is not served on replicated extent {extent.extent_id}, "
                         "nor on one being moved (collectives use unreplicated regions); open the region again")
    with extent.pin():
        if isinstance(req, (Write, Arithmetic)):
            body = _range(node, peer, extent, req, entry)
        elif isinstance(req, Lock):
            body = _lock(node, peer, extent, req, entry)
        else:
            assert isinstance(req, (FetchAdd, CompareSwap))
            ops.check_word(req)
            with extent.lock:
                cfg = primary(node, extent)
                if entry is not None and entry.applied:
                    body = entry.body     # applied and forwarded by an earlier attempt
                else:
                    body = ops.atomic_locked(extent, req)
                    if entry is not None:
                        entry.applied, entry.body = 8, body
                    node.replication.forward(extent, cfg, req)
    node.replication.settle(extent.extent_id)
    if not extent.live:
        raise ExtentNotFound(f"extent {extent.extent_id} was released during the operation")
    return body


def _range(node: Node, peer: Peer, extent: Extent, req: Write | Arithmetic, entry: Entry | None) -> bytes:
    """WRITE, ACCUMULATE, AXPY, SCALE on a primary, piece by piece."""
    dt = kernels.check_arith(req.arith, req.dtype, req.offset, req.length) \
        if isinstance(req, Arithmetic) else None

    def forward(cfg: ReplicaConfig | None, first: int, end: int, part: memoryview | None) -> None:
        assert cfg is not None
        if entry is not None:
            entry.applied = end
        piece = dataclasses.replace(req, offset=req.offset + first, length=end - first,
                                    whole=(req.offset, req.length))
        node.replication.forward(extent, cfg, piece, [part] if part is not None else [])
    ops.apply_stream(peer, extent, req, dt, entry.applied if entry is not None else 0,
                     guard=lambda: primary(node, extent), after=forward)
    if isinstance(req, Write):
        peer.stats.add(bytes_written=req.length)
    elif req.op is not Op.SCALE:
        peer.stats.add(bytes_accumulated=req.length)
    return b""


def _lock(node: Node, peer: Peer, extent: Extent, req: Lock, entry: Entry | None) -> bytes:
    """LOCK/UNLOCK on a primary: served as usual; once the word changed (under the
    extent's lock) it goes to the backups as a :class:`~.requests.LockPiece`."""
    if entry is not None and entry.applied:   # taken and forwarded by an earlier attempt
        primary(node, extent)
        return entry.body
    new = req.holder if req.op is Op.LOCK else 0

    def applied(before: int) -> None:
        cfg = primary(node, extent)
        if entry is not None:
            entry.applied, entry.body = 8, coord_ops.word(before)
        node.replication.forward(extent, cfg, LockPiece(req.op, 0, req.extent_id, req.offset, 8, req.client,
                                                        req.seq, word=new, answer=before))
    return coord_ops.serve(node.waiters, req, extent, peer.cancelled, applied)


# -- a backup's path --------------------------------------------------------------------------
def piece_what(req: Request) -> tuple[tuple[int, ...], int, int]:
    """The exactly-once ``what`` of the client request a forwarded piece belongs to, and
    the piece's start and end relative to that request (bytes)."""
    if req.op in RANGED_OPS and isinstance(req, (Write, Arithmetic)):
        start, length = req.whole
        return ((int(req.op), req.extent_id, start, length, req.dtype_code()),
                req.offset - start, req.offset - start + req.length)
    return (int(req.op), req.extent_id, req.offset, req.length, req.dtype_code()), 0, req.length


def piece(node: Node, peer: Peer, req: Request) -> bytes:
    """A piece the primary forwarded (see the module docstring)."""
    ticket = peer.tickets.get(req.extent_id)
    assert ticket is not None
    extent = peer.tickets.check(node.arena, req.extent_id, write=True)
    extent.check_range(req.offset, req.length)
    node.replication.admit_piece(ticket, req.extent_id)
    if req.op not in REPLICATED_OPS:
        raise InvalidArgument(f"{req.op.name.lower()} is not forwarded to replicas")
    def current() -> None:   # under the extent's lock, before each chunk of a ranged piece
        node.replication.admit_piece(ticket, req.extent_id)

    with extent.pin():
        if not req.seq:
            return _apply_piece(peer, extent, req, 0, current)
        what, start, end = piece_what(req)
        try:
            fresh, entry = node.dedup.begin(req.client, req.seq, peer.dedup_wait, what)
        except TimeoutError as exc:
            raise Timeout(f"{exc}: retry later") from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if not fresh:
            peer.stats.add(repeats=1)
            return b""
        try:
            if entry.applied == 0:
                entry.applied = start
            if entry.applied < start:
                raise InvalidArgument(f"piece [{start}, {end}) of request {req.seq} of client {req.client:#x}: "
                                      f"only {entry.applied} bytes of it arrived before")
            body = _apply_piece(peer, extent, req, min(entry.applied, end) - start, current)
            entry.applied = max(entry.applied, end)
        except BaseException:
            node.dedup.interrupt(entry)
            raise
        if entry.applied >= what[3]:
            entry.finish(Status.OK, body)
        else:
            node.dedup.interrupt(entry)   # the next piece continues it
    return body


def _apply_piece(peer: Peer, extent: Extent, req: Request, skip: int,
                 current: Callable[[], None]) -> bytes:
    """Apply a forwarded piece, after its first ``skip`` bytes (received and dropped).
    ``current()`` runs under the extent's lock before each chunk of a ranged piece and
    raises once the piece's view is not the copy's (a new primary began to copy its
    bytes here while the old primary's piece was still streaming in: the rest of it
    must land neither on those bytes nor in the exactly-once table)."""
    if isinstance(req, (FetchAdd, CompareSwap)):
        ops.check_word(req)
        with extent.lock:
            return ops.atomic_locked(extent, req)
    if isinstance(req, LockPiece):   # store the primary's word, answer its answer
        ops.check_word(req)
        with extent.lock, extent.data[req.offset:req.offset + 8] as word:
            word[:] = coord_ops.word(req.word)
        return coord_ops.word(req.answer)
    if isinstance(req, (Write, Arithmetic)):
        dt = kernels.check_arith(req.arith, req.dtype, req.offset, req.length) \
            if isinstance(req, Arithmetic) else None
        ops.apply_stream(peer, extent, req, dt, skip, guard=current)
        return b""
    raise InvalidArgument(f"{req.op.name.lower()} is not forwarded to replicas")


def seed(node: Node, peer: Peer, req: Seed) -> bytes:
    """The exactly-once entries a primary hands this copy after filling it (over its
    replica ticket, at the current view): taken where this table has none."""
    ticket = peer.tickets.get(req.extent_id)
    if ticket is None or not req.forwarded:
        raise InvalidArgument("exactly-once entries are taken from a primary only (replica ticket)")
    peer.tickets.check(node.arena, req.extent_id, write=True)
    node.replication.admit_piece(ticket, req.extent_id)
    if req.forget:   # a sync begins: the entries an earlier primary's pieces left go
        dropped = node.dedup.forget(req.extent_id)
        log.debug("extent %d: a sync begins, %d exactly-once entries dropped", req.extent_id, dropped)
        return b""
    payload = bytearray(req.length)
    with peer.payload(req.length) as src:
        src.into(memoryview(payload))
    # filed under this copy's extent id, which a retry at this copy names
    records = [(client, seq, (what[0], req.extent_id, *what[2:]), applied, done, status, body)
               for client, seq, what, applied, done, status, body in unpack_records(payload)]
    taken = node.dedup.seed(records)
    log.debug("extent %d: %d of %d exactly-once entries taken from the primary", req.extent_id, taken,
              len(records))
    return b""

