"""A collective's ``REDUCE`` requests on one rdma queue pair (formats in
:mod:`smb_protocol.rdma_wire`; the tcp plane's twin is its connection with
:mod:`.deliveries`).

The client RDMA-WRITEs each chunk into its connection's staging area (memory this
server registered for that party) and SENDs a ``REDUCE`` naming the staging range and
the registered buffers the sum goes to. The plane's progress thread only parses the
message and queues it here; nothing that waits runs on it. Two threads per queue pair
that uses collectives serve the rest, in the order the client sent:

* the push thread applies each push straight from the staging area (no receive copy;
  exactly once, :mod:`.collective_ops`), then SENDs a ``PUSHED`` reply (the client may
  reuse that staging range) and queues the chunk's pull;
* the pull thread waits until every party's push is in, RDMA-WRITEs the sum from the
  extent's own registration into the client's buffers (a sum narrowed to a 16-bit wire
  type goes from a registered scratch buffer), SENDs the final reply and waits for its
  completion before the pull is counted: a completed SEND means the client has the
  sum, and the slot may then take the next round.

A pull whose queue pair broke before its completion is not counted: the client sends
the ``REDUCE`` again on a new queue pair with the same numbers and gets the sum again.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from smb_protocol import requests, wire
from smb_protocol.errors import InvalidArgument, ProtocolError, SMBError, error_status
from smb_protocol.rdma.endpoint import RegisteredBuffer
from smb_protocol.rdma_wire import FINAL, PUSHED, ReduceMessage
from smb_protocol.requests import Pull
from smb_protocol.wire import Op

from .access import TicketBook
from .deliveries import Deliveries
from .engine import Engine
from .peer import Repeat, Whole
from .stats import PlaneStats

log = logging.getLogger(__name__)

_Destinations = tuple[tuple[int, int, int], ...]


class Poster(Protocol):
    """What the reduce service needs of its queue pair (:class:`.rdma_connection.ServerConnection`)."""

    name: str
    tickets: TicketBook
    stats: PlaneStats
    doomed: str

    def staging_view(self, offset: int, length: int) -> memoryview: ...

    def reply(self, req_id: int, status: int, message: str = "", kind: int = FINAL) -> None: ...

    def write_and_reply(self, req_id: int, writes: list[tuple[int, int, int, int, int]]) -> None: ...

    def new_buffer(self, length: int) -> RegisteredBuffer: ...


class ReduceService:
    """The ``REDUCE`` requests of one queue pair (``conn``, borrowed): its push and pull
    threads, and the destinations of the sums still owed. ``local_key(extent_id,
    address, length)``: the lkey of the extent registration covering that memory (None
    when none does). Owns its scratch buffer; :meth:`stop` ends the threads."""

    dedup_wait = 5.0          # the engine's view (.peer.Peer): seconds a repeat waits for its first attempt
    #                           (one on a queue pair the client gave up, which stops once its BYE is in)
    takes_replicated = False  # collectives refuse replicated extents anyway

    def __init__(self, conn: Poster, engine: Engine, local_key: Callable[[int, int, int], int | None]) -> None:
        self.conn = conn
        self.engine = engine
        self.local_key = local_key
        self._lock = threading.Lock()
        self._owed: dict[int, tuple[int, _Destinations]] = {}   # req_id -> (extent_id, destinations)
        self._staging_at = 0
        self._scratch: RegisteredBuffer | None = None
        self._stopped = False
        self._pushes: Deliveries[ReduceMessage] = Deliveries(
            self._push, lambda m, err: self._answer_error(m.req_id, err), self._broken, f"{conn.name} push")
        self._pulls: Deliveries[Pull] = Deliveries(
            lambda pull: engine.deliver(self, pull), lambda p, err: self._answer_error(p.req_id, err),
            self._broken, f"{conn.name} pull")

    # -- the engine's view of this queue pair (.peer.Peer) ---------------------------------
    @property
    def name(self) -> str:
        return self.conn.name

    @property
    def tickets(self) -> TicketBook:
        return self.conn.tickets

    @property
    def stats(self) -> PlaneStats:
        return self.conn.stats

    def cancelled(self) -> bool:
        return self._stopped or bool(self.conn.doomed)

    @contextmanager
    def payload(self, length: int) -> Iterator[Whole]:
        """The push being served: ``length`` bytes of the staging area (no copy)."""
        yield Whole(self.conn.staging_view(self._staging_at, length))

    def send(self, req_id: int, view: memoryview) -> None:
        """Write the sum ``view`` into the request's destinations, then its final reply;
        returns once the reply's SEND completed (the client has the sum)."""
        with self._lock:
            owed = self._owed.pop(req_id, None)
        if owed is None:
            raise ProtocolError(f"rdma {self.name}: no destinations for request {req_id}")
        extent_id, dests = owed
        total = sum(n for _, _, n in dests)
        if total != len(view):
            raise InvalidArgument(f"a sum of {len(view)} bytes for destinations of {total} bytes")
        address, lkey = self._source(extent_id, view)
        writes, pos = [], 0
        for raddr, rkey, n in dests:
            if n:
                writes.append((address + pos, lkey, n, raddr, rkey))
            pos += n
        self.conn.write_and_reply(req_id, writes)
        self.stats.add(bytes_read=len(view))

    def _source(self, extent_id: int, view: memoryview) -> tuple[int, int]:
        """(address, lkey) of registered memory holding ``view``'s bytes: the extent's
        own registration, or the scratch buffer it is copied into."""
        if len(view):
            address = int(np.frombuffer(view, np.uint8, count=1).ctypes.data)
            lkey = self.local_key(extent_id, address, len(view))
            if lkey is not None:
                return address, lkey
        if self._scratch is None:
            self._scratch = self.conn.new_buffer(wire.MAX_CHUNK)
        if len(view) > self._scratch.length:
            raise InvalidArgument(f"a sum of {len(view)} bytes exceeds {self._scratch.length}")
        self._scratch.view[:len(view)] = view
        return self._scratch.address, self._scratch.lkey

    # -- queueing -------------------------------------------------------------------------
    def submit(self, msg: ReduceMessage) -> None:
        """Queue a parsed ``REDUCE`` (the progress thread)."""
        with self._lock:
            self._owed[msg.req_id] = (msg.extent_id, msg.destinations)
        self._pushes.put(msg)

    def _push(self, msg: ReduceMessage) -> None:
        req = requests.from_frame(Op.REDUCE, msg.dtype, msg.req_id, msg.extent_id, msg.offset, msg.length,
                                  msg.arg0, msg.arg1, msg.timeout, msg.client, msg.seq)
        assert isinstance(req, requests.Reduce)
        self._staging_at = msg.staging_offset
        try:
            self.engine.handle(self, req)
        except Repeat as rep:
            self._forget(msg.req_id)
            self.stats.add(operations=1, errors=1)
            self.conn.reply(msg.req_id, rep.status, rep.body.decode(errors="replace"))
            return
        self.stats.add(operations=1)
        self.conn.reply(msg.req_id, 0, kind=PUSHED)
        pull = req.pull()
        self._pulls.put(pull)

    def _answer_error(self, req_id: int, err: SMBError) -> None:
        self._forget(req_id)
        self.stats.add(operations=1, errors=1)
        log.debug("rdma %s: reduce %d failed: %s", self.name, req_id, err)
        self.conn.reply(req_id, error_status(err), str(err))

    def _forget(self, req_id: int) -> None:
        with self._lock:
            self._owed.pop(req_id, None)

    def _broken(self, exc: BaseException) -> None:
        """A reply could not go out: the queue pair cannot go on (the client sends again)."""
        if not self.cancelled():
            log.info("rdma %s: reduce service stops: %s", self.name, exc)
        self.conn.doomed = self.conn.doomed or f"reduce service failed: {exc}"

    def stop(self) -> None:
        """End both threads (without waiting: a wait notices through :meth:`cancelled`)."""
        self._stopped = True
        self._pushes.stop(join=False)
        self._pulls.stop(join=False)

    def close(self) -> None:
        """Stop, then free the scratch buffer (the queue pair is closed)."""
        self.stop()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
