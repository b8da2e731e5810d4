"""A pipelined connection for a collective's ``REDUCE`` requests (see :mod:`smb_protocol.wire`).

One :class:`ReduceStream` per memory server and client: one long-lived socket on which
the caller sends ``REDUCE`` frames back to back, without waiting for answers, while a
receiving thread of the stream takes the answers as they come: the server's word that
a push took effect (``PUSHED``, which frees the sender's window) and, once every party's
push of the chunk landed, the chunk's sum, received straight into the caller's buffers
(both taken whole by the native reader of ``answers.c``, without the interpreter lock).
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
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from smb_protocol import wire
from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.errors import ProtocolError, ServerUnavailable, SMBError
from smb_protocol.framing import ClientFrames
from smb_protocol.requests import Reduce
from smb_protocol.rounds import ChunkRound
from smb_protocol.wire import Op

from ._answers import Answers
from .errors import ConnectionBroken

log = logging.getLogger(__name__)

_HELLO = object()   # the pending entry of a HELLO frame
#: seconds :meth:`ReduceStream.close` waits for each receiving thread to end (its
#: connection is shut down first, so it ends at once)
RECEIVER_JOIN = 10.0


class Connection(Protocol):
    """What a stream needs of a connection (a :class:`~.tcp.TcpConnection`): its socket,
    its client id, its frames (:class:`~smb_protocol.framing.ClientFrames`: the request
    numbers and presented tickets of this connection) and its dead-peer time."""

    sock: socket.socket
    client_id: int
    frames: ClientFrames
    dead_peer_timeout: float

    def close(self) -> None: ...


class Reduction:
    """One ``REDUCE`` in flight: push ``parts`` (the chunk as it travels, of the chunk
    ``types`` of :mod:`smb_protocol.chunk_types`) as the chunk at ``offset`` of extent
    ``extent_id`` into the round ``ref`` names, and receive the sum into ``into``
    (default: ``parts``), then call ``received()`` (when given: it unpacks a sum that
    came in another type). ``pushed()`` is called when the push took effect,
    ``done(error)`` once with None (the sum is in) or the typed error; all run on the
    stream's receiving thread and must be quick."""

    __slots__ = ("extent_id", "offset", "parts", "nbytes", "types", "ref", "timeout", "seq", "pushed", "done",
                 "into", "answer_nbytes", "received")

    def __init__(self, extent_id: int, offset: int, parts: Sequence[memoryview], types: ChunkTypes,
                 ref: ChunkRound, timeout: float, seq: int,
                 pushed: Callable[[], None], done: Callable[[SMBError | None], None],
                 into: Sequence[memoryview] | None = None, received: Callable[[], None] | None = None) -> None:
        self.extent_id = extent_id
        self.offset = offset
        self.parts = list(parts)
        self.nbytes = sum(len(p) for p in self.parts)
        self.types = types
        self.ref = ref
        self.timeout = timeout
        self.seq = seq
        self.pushed = pushed
        self.done = done
        self.into = self.parts if into is None else list(into)
        self.answer_nbytes = sum(len(p) for p in self.into)
        self.received = received

    def request(self, client_id: int) -> Reduce:
        """The typed ``REDUCE`` of this reduction, numbered for ``client_id``."""
        return Reduce(Op.REDUCE, 0, self.extent_id, self.offset, self.nbytes, client_id if self.seq else 0,
                      self.seq, dtype=self.types.code(), ref=self.ref, timeout=self.timeout)


class Reducer(Protocol):
    """What the exchanger (:mod:`smb_client.exchange`) sends a collective's chunks
    through: this module's :class:`ReduceStream` (tcp) or
    :class:`~smb_client.transports.rdma.reduce.RdmaReduceStream`."""

    where: str

    def send(self, ticket: str, r: Reduction) -> None: ...

    def in_flight(self) -> int: ...

    def abandon(self) -> None: ...

    def close(self) -> None: ...


class _Link:
    """One connection of a stream and what is in flight on it (request id -> the
    reduction, or :data:`_HELLO`): answers read from a connection are looked up in its
    own table only, so nothing read from a broken connection can finish a request sent
    on its successor. ``answers``: the native reader of its answers (``answers.c``: a
    push's word and a sum taken whole without the interpreter; a stream is plain tcp,
    the route hands out none over TLS)."""

    __slots__ = ("conn", "pending", "answers")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pending: dict[int, Reduction | object] = {}
        self.answers = Answers(conn.sock.fileno())


class ReduceStream:
    """The pipelined ``REDUCE`` connection to one memory server; ``connect()`` opens a
    :class:`~.tcp.TcpConnection` (with the session's timeouts, keepalive and client id)."""

    def __init__(self, connect: Callable[[], Connection], where: str) -> None:
        self._connect = connect
        self.where = where
        self._sending = threading.Lock()     # one sender at a time
        self._lock = threading.Lock()        # the link and what is in flight on it
        self._link: _Link | None = None
        self._closed = False
        self._receivers: list[threading.Thread] = []   # receiving threads not yet seen to end

    def send(self, ticket: str, r: Reduction) -> None:
        """Send ``r`` (presenting ``ticket`` first if this connection has not); its
        outcome comes through its callbacks, a failure to send included. One caller
        sends at a time; the receiving thread never waits for a sender (a sender blocked
        on a full socket must not keep the answers from being read)."""
        with self._sending:
            try:
                link = self._link if self._link is not None else self._open()
            except SMBError as exc:   # could not connect: fail this one alone
                r.done(exc)
                return
            conn = link.conn
            frames: list[memoryview | bytes] = []
            with self._lock:
                broke = self._link is not link   # it broke meanwhile (its requests were failed)
                if not broke:
                    hello = conn.frames.hello(ticket)
                    if hello is not None:
                        link.pending[hello[0]] = _HELLO
                        frames += hello[1]
                    req_id, request = conn.frames.request(r.request(conn.client_id), r.parts)
                    link.pending[req_id] = r
                    link.answers.expect(req_id, r.into)
                    frames += request
            if broke:
                r.done(ConnectionBroken(f"{self.where}: the connection broke"))
                return
            try:
                wire.sendmsg_all(conn.sock, frames)
                return
            except OSError as exc:
                failed = ConnectionBroken(f"{self.where}: {exc}")
        self._fail(link, failed)

    def _open(self) -> _Link:
        """A new connection and its receiving thread (the caller sends)."""
        with self._lock:
            if self._closed:
                raise ServerUnavailable(f"{self.where}: the stream is closed")
        conn = self._connect()
        conn.sock.settimeout(None)   # the kernel's dead-peer detection bounds every wait
        link = _Link(conn)
        receiver = threading.Thread(target=self._receive, args=(link,), name=f"smb-reduce {self.where}",
                                    daemon=True)
        with self._lock:
            # asked again where the link is recorded: a close while this one connected
            # would neither abandon the link nor wait for its receiving thread
            if self._closed:
                conn.close()
                raise ServerUnavailable(f"{self.where}: the stream is closed")
            self._link = link
            self._receivers = [t for t in self._receivers if t.is_alive()] + [receiver]
            receiver.start()   # under the lock: a close never sees a thread it cannot join
        return link

    def _receive(self, link: _Link) -> None:
        """Take answers until the connection ends; then fail what is still in flight."""
        conn = link.conn
        sock, frames = conn.sock, conn.frames
        try:
            while True:
                header, taken = link.answers.receive()
                answer = frames.answer(header)
                with self._lock:
                    r = link.pending.get(answer.req_id)
                if r is None:
                    if answer.unsolicited:   # the server's parting answer, then it closes
                        raise frames.error(answer, wire.recv_exact(sock, answer.length) if answer.length else b"")
                    raise frames.stray(answer)
                if r is _HELLO or answer.kind == wire.PUSHED or not answer.ok:
                    body = bytes(wire.recv_exact(sock, answer.length)) if answer.length and not taken else b""
                    if not answer.ok:
                        err = frames.error(answer, body)
                        if r is _HELLO:   # a refused ticket: the server closes the connection
                            raise err
                        self._finish(link, answer.req_id, err)
                    elif r is _HELLO:
                        self._finish(link, answer.req_id, None)
                    else:
                        assert isinstance(r, Reduction)
                        r.pushed()
                    continue
                assert isinstance(r, Reduction)
                if not taken:   # the reader takes every sum of the length registered
                    raise ProtocolError(f"{self.where}: a sum of {answer.length} bytes where "
                                        f"{r.answer_nbytes} were due")
                if r.received is not None:
                    r.received()
                self._finish(link, answer.req_id, None)
        except TimeoutError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self._fail(link, ServerUnavailable(
                    f"{self.where}: the server acknowledged nothing for {conn.dead_peer_timeout:g} s "
                    "(host or link down)"))
            else:
                self._fail(link, ConnectionBroken(f"{self.where}: {exc}"))
        except OSError as exc:
            self._fail(link, ConnectionBroken(f"{self.where}: {exc}"))
        except SMBError as exc:
            if isinstance(exc, ServerUnavailable) and not isinstance(exc, ConnectionBroken):
                exc = ConnectionBroken(str(exc))   # closed by the server mid-answer: a break
            self._fail(link, exc)
        finally:
            link.answers.close()   # this thread's alone: no read of it is left

    def _finish(self, link: _Link, req_id: int, err: SMBError | None) -> None:
        with self._lock:
            r = link.pending.pop(req_id, None)
        if err is not None:
            link.answers.forget(req_id)   # a sum taken is dropped by the reader
        if isinstance(r, Reduction):
            r.done(err)

    def _fail(self, link: _Link, err: SMBError) -> None:
        """``link`` is done for: close it and fail everything in flight on it."""
        with self._lock:
            if self._link is link:
                self._link = None
            elif not link.pending:
                return          # failed before: closed, nothing left in flight
            pending, link.pending = link.pending, {}
        try:
            link.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.answers.forget_all()
        link.conn.close()
        if pending:
            log.info("%s: %d requests in flight failed: %s", self.where, len(pending), err)
        for r in pending.values():
            if isinstance(r, Reduction):
                r.done(err)

    def in_flight(self) -> int:
        """Requests sent and not finished."""
        with self._lock:
            link = self._link
            return 0 if link is None else sum(1 for r in link.pending.values() if r is not _HELLO)

    def abandon(self) -> None:
        """Close the connection now, failing what is in flight (a failed round leaves
        requests the server would otherwise keep waiting on)."""
        with self._lock:
            link = self._link
        if link is not None:
            self._fail(link, ConnectionBroken(f"{self.where}: abandoned"))

    def close(self) -> None:
        """Fail what is in flight, close the connection and wait for the receiving
        threads to end: one that outlived the close could drop the last reference to a
        caller's buffer (a torch tensor's memory) while the interpreter shuts down, and a
        thread freeing a tensor then aborts the process."""
        with self._lock:
            self._closed = True
            receivers, self._receivers = self._receivers, []
        self.abandon()
        for receiver in receivers:
            if receiver is not threading.current_thread():
                receiver.join(RECEIVER_JOIN)
