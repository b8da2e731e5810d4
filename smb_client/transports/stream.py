"""A pipelined connection for a collective's ``REDUCE`` requests (see :mod:`smb_protocol.wire`).

One :class:`ReduceStream` per memory server and client: one long-lived socket on which
the caller sends ``REDUCE`` frames back to back, without waiting for answers, while a
receiving thread of the stream takes the answers as they come: the server's word that
a push took effect (``PUSHED``, which frees the sender's window) and, once every party's
push of the chunk landed, the chunk's sum, received straight into the caller's buffers.
There is no round trip per chunk and no thread per chunk: one sending caller and one
receiving thread per server.

Tickets are presented on the stream as on any connection (``HELLO``, once per ticket),
pipelined like the rest; a refused ticket fails what is in flight with its typed error
(the server closes the connection). A connection that breaks fails every request in
flight with :class:`~smb_client.transports.errors.ConnectionBroken` (or
:class:`~smb_protocol.errors.ServerUnavailable` when the server acknowledged nothing
for the dead-peer time); the next send opens a new connection. Requests are numbered,
so the caller may send them again: the server applies a push and counts a pull at most
once, and answers a repeated pull with the sum again.
"""
from __future__ import annotations

import errno
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from smb_protocol import wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import ProtocolError, ServerUnavailable, SMBError, status_error
from smb_protocol.rounds import ChunkRound

from .errors import ConnectionBroken

log = logging.getLogger(__name__)

_HELLO = object()   # the pending entry of a HELLO frame


class Connection(Protocol):
    """What a stream needs of a connection (a :class:`~.tcp.TcpConnection`)."""

    sock: socket.socket
    client_id: int
    dead_peer_timeout: float

    def close(self) -> None: ...


class Reduction:
    """One ``REDUCE`` in flight: push ``parts`` (``dtype`` elements) as the chunk at
    ``offset`` of extent ``extent_id`` into the round ``ref`` names, and receive the sum
    into ``parts``. ``pushed()`` is called when the
    push took effect, ``done(error)`` once with None (the sum is in ``parts``) or the
    typed error; both run on the stream's receiving thread and must be quick."""

    __slots__ = ("extent_id", "offset", "parts", "nbytes", "dtype", "ref", "timeout", "seq", "pushed", "done")

    def __init__(self, extent_id: int, offset: int, parts: Sequence[memoryview], dtype: DType,
                 ref: ChunkRound, timeout: float, seq: int,
                 pushed: Callable[[], None], done: Callable[[SMBError | None], None]) -> None:
        self.extent_id = extent_id
        self.offset = offset
        self.parts = list(parts)
        self.nbytes = sum(len(p) for p in self.parts)
        self.dtype = dtype
        self.ref = ref
        self.timeout = timeout
        self.seq = seq
        self.pushed = pushed
        self.done = done


class ReduceStream:
    """The pipelined ``REDUCE`` connection to one memory server; ``connect()`` opens a
    :class:`~.tcp.TcpConnection` (with the session's timeouts, keepalive and client id)."""

    def __init__(self, connect: Callable[[], Connection], where: str) -> None:
        self._connect = connect
        self.where = where
        self._sending = threading.Lock()     # one sender at a time
        self._lock = threading.Lock()        # the connection and the table of what is in flight
        self._conn: Connection | None = None
        self._pending: dict[int, Reduction | object] = {}
        self._presented: set[str] = set()
        self._ids = itertools.count(1)
        self._closed = False

    def send(self, ticket: str, r: Reduction) -> None:
        """Send ``r`` (presenting ``ticket`` first if this connection has not); its
        outcome comes through its callbacks, a failure to send included. One caller
        sends at a time; the receiving thread never waits for a sender (a sender blocked
        on a full socket must not keep the answers from being read)."""
        with self._sending:
            try:
                conn = self._conn if self._conn is not None else self._open()
            except SMBError as exc:   # could not connect: fail this one alone
                r.done(exc)
                return
            frames: list[memoryview | bytes] = []
            with self._lock:
                broke = self._conn is not conn   # it broke meanwhile (its requests were failed)
                if not broke and ticket not in self._presented:
                    token = ticket.encode()
                    hello_id = self._next_id()
                    self._pending[hello_id] = _HELLO
                    frames += [wire.pack_request(wire.Op.HELLO, hello_id, length=len(token)), token]
                    self._presented.add(ticket)
                req_id = self._next_id()
                if not broke:
                    self._pending[req_id] = r
            if broke:
                r.done(ConnectionBroken(f"{self.where}: the connection broke"))
                return
            arg0, arg1 = r.ref.args()
            frames.append(wire.pack_request(
                wire.Op.REDUCE, req_id, r.extent_id, r.offset, r.nbytes, r.dtype, arg0, arg1, r.timeout,
                client=conn.client_id if r.seq else 0, seq=r.seq))
            frames += r.parts
            try:
                wire.sendmsg_all(conn.sock, frames)
                return
            except OSError as exc:
                failed = ConnectionBroken(f"{self.where}: {exc}")
        self._fail(conn, failed)

    def _next_id(self) -> int:
        return next(self._ids) & 0xFFFFFFFF or next(self._ids)

    def _open(self) -> Connection:
        """A new connection and its receiving thread (the caller sends)."""
        with self._lock:
            if self._closed:
                raise ServerUnavailable(f"{self.where}: the stream is closed")
        conn = self._connect()
        conn.sock.settimeout(None)   # the kernel's dead-peer detection bounds every wait
        with self._lock:
            self._conn = conn
            self._presented = set()
        threading.Thread(target=self._receive, args=(conn,), name=f"smb-reduce {self.where}",
                         daemon=True).start()
        return conn

    def _receive(self, conn: Connection) -> None:
        """Take answers until the connection ends; then fail what is still in flight."""
        sock = conn.sock
        try:
            while True:
                status, kind, req_id, n = wire.unpack_answer(wire.recv_exact(sock, wire.RESPONSE.size))
                with self._lock:
                    r = self._pending.get(req_id)
                if r is None:
                    if req_id == 0 and status:   # the server's parting answer, then it closes
                        body = bytes(wire.recv_exact(sock, n)) if n else b""
                        raise status_error(status, f"{self.where}: {body.decode(errors='replace')}")
                    raise ProtocolError(f"{self.where}: an answer to request {req_id}, not in flight")
                if r is _HELLO or kind == wire.PUSHED or status:
                    body = bytes(wire.recv_exact(sock, n)) if n else b""
                    if status:
                        err = status_error(status, f"{self.where}: {body.decode(errors='replace')}")
                        if r is _HELLO:   # a refused ticket: the server closes the connection
                            raise err
                        self._finish(req_id, err)
                    elif r is _HELLO:
                        self._finish(req_id, None)
                    else:
                        assert isinstance(r, Reduction)
                        r.pushed()
                    continue
                assert isinstance(r, Reduction)
                if n != r.nbytes:
                    raise ProtocolError(f"{self.where}: a sum of {n} bytes for a chunk of {r.nbytes}")
                wire.recv_into_all(sock, r.parts)
                self._finish(req_id, None)
        except TimeoutError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self._fail(conn, ServerUnavailable(
                    f"{self.where}: the server acknowledged nothing for {conn.dead_peer_timeout:g} s "
                    "(host or link down)"))
            else:
                self._fail(conn, ConnectionBroken(f"{self.where}: {exc}"))
        except OSError as exc:
            self._fail(conn, ConnectionBroken(f"{self.where}: {exc}"))
        except SMBError as exc:
            if isinstance(exc, ServerUnavailable) and not isinstance(exc, ConnectionBroken):
                exc = ConnectionBroken(str(exc))   # closed by the server mid-answer: a break
            self._fail(conn, exc)

    def _finish(self, req_id: int, err: SMBError | None) -> None:
        with self._lock:
            r = self._pending.pop(req_id, None)
        if isinstance(r, Reduction):
            r.done(err)

    def _fail(self, conn: Connection, err: SMBError) -> None:
        """``conn`` is done for: close it and fail everything in flight on it."""
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            pending, self._pending = self._pending, {}
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
        if pending:
            log.info("%s: %d requests in flight failed: %s", self.where, len(pending), err)
        for r in pending.values():
            if isinstance(r, Reduction):
                r.done(err)

    def in_flight(self) -> int:
        """Requests sent and not finished."""
        with self._lock:
            return sum(1 for r in self._pending.values() if r is not _HELLO)

    def abandon(self) -> None:
        """Close the connection now, failing what is in flight (a failed round leaves
        requests the server would otherwise keep waiting on)."""
        with self._lock:
            conn = self._conn
        if conn is not None:
            self._fail(conn, ConnectionBroken(f"{self.where}: abandoned"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.abandon()
