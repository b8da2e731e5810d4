"""The request engine of a memory server: one home for every operation's rules.

A plane (tcp, rdma) decodes a request into a typed object (:mod:`.requests`) and hands
it to :meth:`Engine.handle` together with itself, as the :class:`~.peer.Peer` the
request came from. The engine checks access against the tickets the peer presented,
applies exactly-once (:mod:`.dedup`) and runs the operation against the arena: the
plain operations are :mod:`.ops`', mutations of replicated extents (a primary's and a
backup's path) :mod:`.replica_ops`', collective chunks (``PUSH``/``PULL``)
:mod:`.collective_ops`', waits and locks :mod:`.coord_ops`'. Planes only frame, time
out, greet and answer.

The payload of a request comes from its peer (:meth:`~.peer.Peer.payload`): from the
socket for tcp (received into scratch, or for a plain write straight into the
extent's mapping), from the connection's registered staging area for rdma (no copy).
"""
from __future__ import annotations

import logging

from smb_protocol import tracing
from smb_protocol.errors import InvalidArgument, NotPrimary, Status
from smb_protocol.requests import (
    Arithmetic,
    CompareSwap,
    FetchAdd,
    Lock,
    Ping,
    Pull,
    Push,
    Read,
    Request,
    Seed,
    Wait,
    Write,
)
from smb_protocol.wire import WRITE_OPS

from . import collective_ops, coord_ops, ops, replica_ops
from .arena import Extent
from .dedup import Entry
from .node import Node
from .peer import Peer, Repeat

log = logging.getLogger(__name__)


class Engine:
    """Serves typed requests against a :class:`~.node.Node` (borrowed). Thread-safe:
    every connection thread calls it."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def handle(self, peer: Peer, req: Request) -> bytes | None:
        """Serve one request; returns the OK answer's body, or None when the operation
        already answered through :meth:`~.peer.Peer.send`. Raises typed errors
        (SMBError) and :class:`~.peer.Repeat`. Payload bytes it did not read are the
        plane's to discard. A request that came with a trace context is served in a
        span of that trace (:mod:`smb_protocol.tracing`; nothing while tracing is off)."""
        if req.trace is None:
            return self._handle(peer, req)
        with tracing.serving(f"smb.server.{req.op.name.lower()}", req.trace, {
                "smb.extent": req.extent_id, "smb.offset": req.offset, "smb.bytes": req.length,
                "smb.peer": peer.name}):
            return self._handle(peer, req)

    def _handle(self, peer: Peer, req: Request) -> bytes | None:
        if isinstance(req, Ping):
            return b""
        if isinstance(req, Seed):
            return replica_ops.seed(self.node, peer, req)
        if isinstance(req, Pull):
            collective_ops.pull(self.node, peer, req)   # answers through the peer
            body = None
        elif req.forwarded and req.op in WRITE_OPS:
            body = replica_ops.piece(self.node, peer, req)
        elif req.seq and req.op in WRITE_OPS:
            body = self._once(peer, req)
        else:
            body = self.dispatch(peer, req)
        if req.op in WRITE_OPS:   # wake the waits on the words it changed
            self.node.waiters.touched(req.extent_id, req.offset, req.length)
        return body

    def deliver(self, peer: Peer, pull: Pull) -> None:
        """Send a ``REDUCE``'s sum once its chunk is complete and count the pull
        (:meth:`.requests.Reduce.pull`; the plane queues it, :mod:`.deliveries`)."""
        collective_ops.pull(self.node, peer, pull)

    def _once(self, peer: Peer, req: Request) -> bytes | None:
        """Serve a numbered mutating request at most once (see :mod:`.dedup`).

        The ticket and range are checked first and on every attempt (a retry under a
        renewed ticket passes). A repeat of a finished request gets the first answer; a
        repeat of an interrupted one resumes after the bytes that took effect. A failure
        before anything took effect (for example a ticket that expired) is not
        remembered, so the retry runs the request.
        """
        extent = self._checked(peer, req, write=True)
        fresh, entry, body = self.node.dedup.once(
            req.client, req.seq, req.what(), peer.dedup_wait,
            lambda entry: self.dispatch(peer, req, entry, extent))
        if not fresh:
            peer.stats.add(repeats=1)
            if entry.status != Status.OK:
                raise Repeat(entry.status, entry.body)
            return entry.body
        return body

    def _checked(self, peer: Peer, req: Request, write: bool) -> Extent:
        """The request's extent, once its ticket allows the access and its range lies inside."""
        extent = peer.tickets.check(self.node.arena, req.extent_id, write=write)
        extent.check_range(req.offset, req.length)
        return extent

    def dispatch(self, peer: Peer, req: Request, entry: Entry | None = None,
                 extent: Extent | None = None) -> bytes | None:
        """Serve a request: its access check (unless the caller passes the ``extent`` it
        checked), then the operation. ``entry`` (a numbered request) counts the payload
        bytes that took effect and, on a resumed attempt, says how many to skip."""
        write = req.op in WRITE_OPS
        if extent is None:
            extent = self._checked(peer, req, write)
        replication = self.node.replication
        if write and replication.role(req.extent_id):
            if not peer.takes_replicated:
                raise NotPrimary(f"extent {req.extent_id} is replicated: its mutations go to the "
                                 "primary's tcp data plane")
            return replica_ops.mutate(self.node, peer, extent, req, entry)
        if isinstance(req, Wait):
            return coord_ops.serve(self.node.waiters, req, extent, peer.cancelled)
        if isinstance(req, Push):   # counted only once it stops waiting (collective_ops)
            return collective_ops.push(self.node, peer, extent, req, entry)
        if isinstance(req, Read):
            ops.read(peer, extent, req)
            return None
        if not write:
            raise InvalidArgument(f"{req.op.name.lower()} is not served on this data plane")
        with replication.unreplicated(req.extent_id):   # a move waits for it (replication)
            body = self._unreplicated(peer, extent, req, entry)
            if entry is not None:   # answered while counted: a move's copy hands the entry over
                entry.finish(Status.OK, body or b"")
            return body

    def _unreplicated(self, peer: Peer, extent: Extent, req: Request, entry: Entry | None) -> bytes | None:
        """A mutation of an unreplicated extent."""
        if isinstance(req, Lock):   # a lock that waits stops when a move begins (it is retried)
            replication = self.node.replication
            return coord_ops.serve(self.node.waiters, req, extent,
                                   lambda: peer.cancelled() or bool(replication.role(req.extent_id)))
        if isinstance(req, Write):
            return ops.write(peer, extent, req)
        if isinstance(req, (FetchAdd, CompareSwap)):
            ops.check_word(req)
            with extent.pin(), extent.lock:
                return ops.atomic_locked(extent, req)
        if isinstance(req, Arithmetic):
            return ops.arithmetic(peer, extent, req, entry)
        raise InvalidArgument(f"{req.op.name.lower()} is not served on this data plane")
