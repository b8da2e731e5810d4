"""The TCP data plane of a memory server (protocol: :mod:`smb_protocol.wire`).

One accept thread and one thread per connection. A connection presents tickets with
``HELLO`` frames, one per region its client uses here, at any time; each request is
checked against the ticket naming its extent (see :class:`.access.TicketBook`) and the
arena, then served straight between the socket and extent memory: ``READ`` sends from
the mapping with ``sendmsg``, ``WRITE`` receives into it with ``recvmsg_into`` (no
copies); ``ACCUMULATE``/``AXPY`` receive into a scratch buffer of at most
:data:`SCRATCH_BYTES` and apply the kernel chunk by chunk under the extent's lock.
Scratch buffers come from one :class:`ScratchPool` per plane, lent for one request and
bounded in bytes across all connections; payloads of at most :data:`SMALL_SCRATCH`
bytes use a buffer made for the request and dropped after it.

Limits, so that peers without a ticket cannot lock the plane up: a connection must
complete its first ``HELLO`` within ``hello_timeout`` seconds of being accepted, and
every frame (header and payload) must arrive whole within ``frame_timeout`` seconds of
its first byte, however slowly it trickles; a connection is then dropped. At most
``max_connections`` connections in all and ``max_per_peer`` from one peer address are
open; one more, or one accepted while the process is out of file descriptors, gets an
unsolicited ``SERVER_BUSY`` answer naming the limit (:class:`ServerBusy` on the client)
and is closed. The accept loop (a :class:`.listener.Listener`) survives EMFILE: it
sheds the waiting connection with a spare descriptor kept for that, and backs off.

With ``tls`` (an :class:`ssl.SSLContext`, from the server's ``tls_*`` settings) every
connection is TLS: the handshake runs on the connection's own thread, within
``hello_timeout`` of the accept (never in the accept loop), on a duplicate of the
socket's descriptor so that :meth:`TcpPlane.close` still reaches it. Refusals for
limits are sent in clear before any handshake (the client reports them as
:class:`ServerBusy`). TLS sockets have no ``sendmsg``/``recvmsg_into``:
:mod:`smb_protocol.wire` hands them to the loops of :mod:`smb_protocol.tls`.

A request that fails a check is answered with a status code and a UTF-8 message after
its payload was read and discarded, so the connection stays usable. A frame that
breaks the protocol (bad magic, unknown opcode, oversized length, truncated frame, no
``HELLO``) closes that connection only.

Each request is decoded once into a typed object (:mod:`.requests`) and served by the
node's :class:`.engine.Engine`; a connection is the engine's :class:`.peer.Peer`: it
hands out the request's payload (:class:`_SocketPayload`) and sends answers with data.
Payload bytes the engine did not read (a refused request, a repeat of a finished one)
are read and discarded before the answer, so the connection stays usable. Once a
plain connection presented a ticket, its frames are read by a native loop that serves
most ``REDUCE`` requests itself, on as many cores as connections are busy, and hands
every other frame here (:mod:`.tcp_native`).
"""
from __future__ import annotations

import errno
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from smb_protocol import requests, rounds, wire
from smb_protocol.errors import (
    InvalidArgument,
    InvalidTicket,
    ServerError,
    SMBError,
    Status,
    Timeout,
    error_status,
)
from smb_protocol.tickets import TicketMode, verify
from smb_protocol.wire import Op

from . import _native, coord_ops, tcp_native, tcp_sums, tcp_tls
from .access import TicketBook
from .deliveries import Deliveries
from .engine import Engine
from .listener import BACKLOG, Listener
from .node import Node
from .peer import Repeat
from .plane import ListeningPlane
from .scratch import SCRATCH_BYTES, SCRATCH_POOL_BYTES, SMALL_SCRATCH, ScratchPool
from .stats import PlaneStats
from .tcp_tls import GOODBYE_LINGER

log = logging.getLogger(__name__)


HELLO_TIMEOUT = 5.0       # seconds from accept to the end of the first HELLO
FRAME_TIMEOUT = 60.0      # seconds from a frame's first byte to its last
DEAD_PEER_TIMEOUT = 3.0   # seconds of unanswered keepalive probes before a waiting connection ends
MAX_CONNECTIONS = 1024    # connections open at once
MAX_PER_PEER = 128        # connections open at once from one peer address
MAX_UNAUTHENTICATED = 256  # connections open at once without a valid HELLO yet (one more evicts one)
_WORD = struct.Struct("<q")   # a pushed REDUCE's answer: the count word it found
_FRAME_HINT = ("a slow or stalled client: raise tcp_frame_timeout_seconds on the memory server "
               "for slow links")


def _late(plane: TcpPlane, dead: bool) -> _Drop:
    """The drop for a receive that timed out: the kernel's (``dead``: ``ETIMEDOUT``, the
    client's host answered no keepalive probe for the dead-peer time) or the frame
    deadline's (a client that is there but slow)."""
    plane.stats.add(dropped=1)
    if dead:
        return _Drop(f"the client's host answered no keepalive probe for {plane.dead_peer_timeout:g} s "
                     "(tcp_dead_peer_seconds): it or its link is gone")
    return _Drop(f"frame not complete within {plane.frame_timeout:g} s "
                 "(tcp_frame_timeout_seconds)", Timeout, _FRAME_HINT)


class _Drop(Exception):
    """The peer broke the protocol, missed a deadline or went away: close this connection.

    ``error``: the class of the parting answer the peer gets (``req_id`` 0) before the
    close, for a peer that spoke the protocol but missed a deadline; None (a peer that
    speaks garbage, or a stream that is mid-answer): closed without one. ``hint`` is
    added to the answer's message and says what to do.
    """

    def __init__(self, message: str, error: type[SMBError] | None = None,
                 hint: str = "") -> None:
        super().__init__(message)
        self.error = error
        self.hint = hint


class _Connection:
    """One client socket and its tickets. Runs on its own thread."""

    def __init__(self, plane: TcpPlane, sock: socket.socket, peer: str) -> None:
        self.plane = plane
        self.sock = sock
        self.peer = peer
        self.tickets = TicketBook()
        self.pending = 0                      # payload bytes of the current request not yet read
        self.hello_deadline = time.monotonic() + plane.hello_timeout
        self.deadline = self.hello_deadline   # monotonic time the current frame must be in by
        self._header = bytearray(wire.REQUEST.size)
        self._sending = _native.Mutex(recursive=True)   # one answer frame at a time (several threads send)
        #: the REDUCEs served natively (native/serve.c); TLS streams are Python's alone
        self.native = (_native.Conn(sock.fileno(), self._sending, plane.node.dedup, plane.frame_timeout)
                       if plane.tls is None else None)
        self._deliveries: Deliveries[requests.Pull] | None = None   # REDUCE sums owed, made on the first
        self.ended = False                    # the reading loop is over
        self._reader = 0                      # the reading thread's ident

    # -- socket helpers -------------------------------------------------------------
    @contextmanager
    def _scratch(self, n: int) -> Iterator[memoryview]:
        """A scratch buffer of ``min(n, SCRATCH_BYTES)`` bytes for this request: a small
        one of its own, or one lent by the plane's pool until the request ends."""
        if n <= SMALL_SCRATCH:
            yield memoryview(bytearray(n))
            return
        try:
            buf = self.plane.scratch.acquire(self.deadline)
        except TimeoutError as exc:
            raise _Drop(f"frame not read within {self.plane.frame_timeout:g} s "
                        f"(tcp_frame_timeout_seconds): {exc}", Timeout,
                        "the memory server is short of scratch buffers: raise "
                        "tcp_scratch_bytes or send smaller accumulates") from None
        try:
            yield memoryview(buf)[:min(n, len(buf))]
        finally:
            self.plane.scratch.release(buf)

    def _recv_header(self) -> bool:
        """Fill the header buffer; False on a clean close between frames.

        Before the first ``HELLO`` the connection waits at most until its HELLO deadline;
        once a ticket is in, it may idle between frames. A frame's first byte starts
        its frame deadline.
        """
        view = memoryview(self._header)
        got = 0
        while got < len(view):
            hello = not self.tickets
            if got:
                deadline: float | None = self.deadline
            else:
                deadline = self.hello_deadline if hello else None
            left = self.plane.frame_timeout if deadline is None else deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                n = self._recv_some(view[got:], left)
            except TimeoutError as exc:
                if self.plane.closing:
                    return False
                if exc.errno == errno.ETIMEDOUT:   # the kernel's: the client's host is gone
                    raise _late(self.plane, exc.errno == errno.ETIMEDOUT) from None
                if deadline is None:
                    continue  # idle between requests: fine
                if hello:
                    self.plane.stats.add(dropped=1)
                    raise _Drop(f"no HELLO within {self.plane.hello_timeout:g} s of connecting "
                                "(tcp_hello_timeout_seconds)", Timeout,
                                "present a ticket right after connecting") from None
                raise _late(self.plane, exc.errno == errno.ETIMEDOUT) from None
            if n == 0:
                if got == 0:
                    return False
                raise _Drop(f"truncated header ({got} of {len(view)} bytes)")
            if got == 0:
                self.deadline = time.monotonic() + self.plane.frame_timeout
                if hello:
                    self.deadline = min(self.deadline, self.hello_deadline)
            got += n
        return True

    def _next_frame(self) -> bool:
        """The next frame Python serves, its header in the buffer; False on a clean close.
        Once a ticket is in, frames are read natively (:mod:`.tcp_native`): the REDUCEs
        it can serve never come here; what it hands over does."""
        if self.native is None or not self.tickets:
            return self._recv_header()
        kind, why, got = tcp_native.frames(self, self._header, lambda: self.plane.closing)
        if kind == _native.EV_DROP:
            if why in (_native.DROP_DEAD_PEER, _native.DROP_FRAME_LATE):
                raise _late(self.plane, why == _native.DROP_DEAD_PEER)
            raise _Drop(f"truncated header ({got} of {wire.REQUEST.size} bytes)" if why == _native.DROP_PROTOCOL
                        else "the connection broke mid-frame (payload or answer)")
        self.deadline = time.monotonic() + self.plane.frame_timeout
        return kind == _native.EV_PYTHON

    def _recv_some(self, view: memoryview, left: float) -> int:
        """Bytes read into ``view`` (0 at end of file), waiting at most ``left`` seconds
        for the first (TimeoutError); a plain socket polls only when none are there."""
        if self.plane.tls is not None:
            self.sock.settimeout(left)
            return self.sock.recv_into(view)
        end = time.monotonic() + left
        while True:
            try:
                return self.sock.recv_into(view)
            except BlockingIOError:
                wire.wait_ready(self.sock, False, end - time.monotonic())

    def _recv(self, view: memoryview) -> None:
        try:
            wire.recv_into_all(self.sock, [view], deadline=self.deadline)
        except TimeoutError as exc:
            raise _late(self.plane, exc.errno == errno.ETIMEDOUT) from None
        except (OSError, SMBError) as exc:
            raise _Drop(f"payload: {exc}") from None
        self.pending -= len(view)

    def _drain(self) -> None:
        if self.pending <= 0:
            return
        with self._scratch(self.pending) as scratch:
            while self.pending > 0:
                self._recv(scratch[:min(self.pending, len(scratch))])

    def _send(self, buffers: list[memoryview | bytes], more: bool = False) -> None:
        """Send one whole answer frame (the reading thread and the deliveries' thread
        both answer, one frame at a time). ``more``: another answer follows at once from
        this thread (the kernel holds this one for that one's segment)."""
        try:
            with self._sending:
                if self.plane.tls is not None:
                    self.sock.settimeout(self.plane.frame_timeout)
                wire.sendmsg_all(self.sock, buffers, socket.MSG_MORE if more else 0,
                                 stall=self.plane.frame_timeout)
        except OSError as exc:
            raise _Drop(f"send: {exc}") from None

    def _reply(self, req_id: int, body: bytes = b"", status: int = Status.OK,
               kind: int = wire.FINAL, more: bool = False) -> None:
        self._send([wire.pack_response(status, req_id, len(body), kind), body], more)

    # -- main loop ------------------------------------------------------------------
    def serve(self) -> None:
        self._reader = threading.get_ident()
        try:
            self._serve_frames()
        finally:
            self.ended = True
            if self.native is not None:
                self.native.end()
            if self._deliveries is not None:
                self._deliveries.stop()

    def _serve_frames(self) -> None:
        try:
            while self._next_frame():
                if not self._request():
                    break
        except _Drop as exc:
            self.plane.stats.add(errors=1)
            log.info("tcp %s: closing connection: %s", self.peer, exc)
            if exc.error is not None:
                hint = f"; {exc.hint}" if exc.hint else ""
                self._goodbye(exc.error(f"the memory server closed the connection: {exc}{hint}"))
        except Exception as exc:
            self.plane.stats.add(errors=1)
            log.exception("tcp %s: unexpected failure; closing connection", self.peer)
            self._goodbye(ServerError(f"the memory server failed serving this connection "
                                      f"({type(exc).__name__}: {exc}); see its log, then "
                                      f"reconnect"))

    def _goodbye(self, err: SMBError) -> None:
        """Send ``err`` as the parting answer (``req_id`` 0) if the socket takes it at once,
        stop sending, then discard what the peer still sends for :data:`GOODBYE_LINGER`
        seconds (if it presented a ticket), so that the close does not reset it away."""
        body = str(err).encode()
        linger = GOODBYE_LINGER if self.tickets else 0.0
        try:
            with self._sending:
                self.sock.settimeout(0.0)
                self.sock.send(wire.pack_response(error_status(err), 0, len(body)) + body)
                self.sock.shutdown(socket.SHUT_WR)
            end = time.monotonic() + linger
            while True:
                left = end - time.monotonic()
                self.sock.settimeout(max(0.0, left))
                if not self.sock.recv(1 << 16) or left <= 0:
                    break
        except OSError:
            pass

    def _request(self) -> bool:
        """Serve one request whose header is in the buffer; False to close the connection.

        Its latency, from the header's arrival to the answer's departure, goes to the
        plane's stats.
        """
        start = time.perf_counter()
        (magic, op_code, dtype, req_id, extent_id, offset, length, arg0, arg1,
         alpha, client, seq) = wire.REQUEST.unpack(self._header)
        if magic != wire.MAGIC:
            raise _Drop(f"bad magic {magic:#x}")
        try:
            op = Op(op_code & ~wire.TRACED)
        except ValueError:
            raise _Drop(f"unknown opcode {op_code}") from None
        if length > wire.MAX_PAYLOAD:
            raise _Drop(f"length {length} exceeds the limit of {wire.MAX_PAYLOAD} bytes")
        self.pending = length if op in wire.PAYLOAD_OPS else 0
        trace = self._trace() if op_code & wire.TRACED else None
        if op is Op.HELLO:
            keep = self._hello(req_id, length)
            self.plane.stats.observe("hello", time.perf_counter() - start)
            return keep
        if not self.tickets:
            raise _Drop(f"{op.name} before HELLO")
        forwarded = (op in wire.WRITE_OPS or op is Op.SEED) and self._forwarded(extent_id)
        try:
            req = requests.from_frame(op, dtype, req_id, extent_id, offset, length, arg0, arg1, alpha,
                                      client, seq, forwarded, trace)
            if isinstance(req, requests.Reduce) and self.plane.tls is not None:
                raise InvalidArgument("reduce is not served over TLS (one thread both reads and "
                                      "writes a TLS stream): use push and pull")
            body = self.plane.engine.handle(self, req)
        except Repeat as rep:           # a retry of a request that failed the first time
            self._drain()
            self.plane.stats.add(errors=1, operations=1)
            self._reply(req_id, rep.body, rep.status)
        except SMBError as exc:
            self._drain()
            self.plane.stats.add(errors=1, operations=1)
            log.debug("tcp %s: %s on extent %d failed: %s", self.peer, op.name, extent_id, exc)
            self._reply(req_id, str(exc).encode(), error_status(exc))
        else:
            self._drain()               # a repeat's payload: read and dropped
            if isinstance(req, requests.Reduce):   # pushed: say so; the sum follows when complete
                self.plane.stats.add(operations=1)
                last = body is not None and rounds.completes(_WORD.unpack(body)[0], req.ref)
                self._reply(req_id, body or b"", kind=wire.PUSHED, more=last)
                tcp_sums.owe(self, self.plane.node, req, last)
                tcp_native.register(self, self.tickets.writable(req.extent_id), req.extent_id)
            elif body is not None:      # else already answered (and counted) by the operation
                self.plane.stats.add(operations=1)
                self._reply(req_id, body)
        self.plane.stats.observe(op.name.lower(), time.perf_counter() - start)
        return True

    def refuse(self, req_id: int, err: SMBError) -> None:
        """Answer request ``req_id`` with ``err`` (a request the native loop gave up)."""
        self.plane.stats.add(operations=1)
        self._reply(req_id, str(err).encode(), error_status(err))

    def _trace(self) -> bytes:
        """The traceparent that follows a traced request's header (:data:`wire.TRACED`)."""
        buf = bytearray(wire.TRACE_SIZE)
        self.pending += len(buf)
        self._recv(memoryview(buf))
        return bytes(buf)

    def deliver(self, pull: requests.Pull) -> None:
        """Send the sum ``pull`` owes now, from whichever thread has it (:mod:`.tcp_sums`)."""
        if self.ended:
            return    # the client asks again on a new connection
        try:
            self.plane.engine.deliver(self, pull)
        except SMBError as exc:
            self.plane.stats.add(errors=1)
            try:
                self._reply(pull.req_id, str(exc).encode(), error_status(exc))
            except _Drop as why:
                self._broken(why)
        except BaseException as exc:
            self._broken(exc)

    def owed(self) -> Deliveries[requests.Pull]:
        """The queue of sums this connection owes (made on its first REDUCE)."""
        if self._deliveries is None:
            self._deliveries = Deliveries(
                lambda pull: self.plane.engine.deliver(self, pull),
                lambda pull, err: self._reply(pull.req_id, str(err).encode(), error_status(err)), self._broken,
                self.peer)
        return self._deliveries

    def _broken(self, exc: BaseException) -> None:
        """The deliveries' thread failed to answer: close the connection (the reading
        thread sees it end; the client sends what it misses again)."""
        self.plane.stats.add(errors=1)
        if isinstance(exc, (_Drop, SMBError)):
            log.info("tcp %s: closing connection: %s", self.peer, exc)
        else:
            log.error("tcp %s: failed sending a sum; closing connection", self.peer, exc_info=exc)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _hello(self, req_id: int, length: int) -> bool:
        if length > wire.MAX_TICKET:
            raise _Drop(f"HELLO ticket of {length} bytes exceeds {wire.MAX_TICKET}")
        with self._scratch(length) as token:
            self._recv(token)
            raw = bytes(token)
        try:
            self.tickets.add(verify(self.plane.node.secret, raw.decode()))
            self.plane._listener.current().authenticated()   # counted from now on (listener.py)
        except (SMBError, UnicodeDecodeError) as exc:
            err = exc if isinstance(exc, SMBError) else InvalidTicket("ticket is not UTF-8")
            self.plane.stats.add(errors=1)
            log.info("tcp %s: HELLO refused: %s", self.peer, err)
            self._reply(req_id, str(err).encode(), error_status(err))
            return False
        self._reply(req_id)
        return True

    def _forwarded(self, extent_id: int) -> bool:
        """Whether this connection presented a replica ticket for the extent: its
        mutations are pieces forwarded by a primary."""
        return self.tickets.get(extent_id, TicketMode.REPLICA) is not None

    # -- the engine's view of this connection (.peer.Peer) ---------------------------------
    @property
    def name(self) -> str:
        return self.peer

    @property
    def node(self) -> Node:
        return self.plane.node

    @property
    def stats(self) -> PlaneStats:
        return self.plane.stats

    @property
    def dedup_wait(self) -> float:
        return self.plane.frame_timeout

    takes_replicated = True

    def payload(self, length: int) -> _SocketPayload:
        """The request's next ``length`` payload bytes, from the socket (a ``with``
        block): into scratch (lent for the block, taken only when needed) or straight
        into a view."""
        return _SocketPayload(self, length)

    def send(self, req_id: int, view: memoryview) -> None:
        self._send([wire.pack_response(Status.OK, req_id, len(view)), view])

    def cancelled(self) -> bool:
        """Whether a waiting request should stop: the plane closes or the peer left. Only
        the reading thread looks at the socket (another thread's look may see its bytes
        go, or block); the deliveries' thread learns it from ``ended``."""
        if self.ended or self.plane.closing:
            return True
        return threading.get_ident() == self._reader and coord_ops.peer_closed(self.sock)


class _SocketPayload:
    """A request's payload as the engine reads it (:class:`.peer.Payload`), from the
    connection's socket; the scratch buffer is taken on the first :meth:`take`."""

    def __init__(self, conn: _Connection, length: int) -> None:
        self.conn = conn
        self.step = max(1, min(length, SCRATCH_BYTES))
        self._scratch: AbstractContextManager[memoryview] | None = None
        self._view: memoryview | None = None

    def take(self, n: int) -> memoryview:
        if self._view is None:
            self._scratch = self.conn._scratch(self.step)
            self._view = self._scratch.__enter__()
        chunk = self._view[:n]
        self.conn._recv(chunk)
        return chunk

    def into(self, view: memoryview) -> None:
        self.conn._recv(view)

    def __enter__(self) -> _SocketPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._scratch is not None:
            self._scratch.__exit__(None, None, None)
            self._scratch = self._view = None


class TcpPlane(ListeningPlane):
    """Listens on ``host:port`` (0: any free port) and serves the TCP data plane.

    Borrows ``node`` (its arena, secret, exactly-once table, ...; not closed here) and
    serves requests with an :class:`.engine.Engine` over it; ``stats`` (a
    :class:`PlaneStats`, shared with other planes) receives counters. Limits (see the
    module docstring): ``max_connections`` in all, ``max_per_peer`` from one peer
    address, ``hello_timeout`` and ``frame_timeout`` (seconds), ``scratch_bytes`` of
    pooled scratch buffers. While a connection waits for its client, the kernel probes
    the client's host and ends the connection once ``dead_peer_timeout`` seconds of
    probes go unanswered, or at once when that host answers that the socket is gone
    (:func:`smb_protocol.wire.set_keepalive`): what a vanished client's request holds
    (its exactly-once entry, which its retry waits for; its scratch) is freed within
    that time, not at the frame deadline. (No ``TCP_USER_TIMEOUT``: it would also end a
    live client slow to read an answer.) Starts serving on construction; :meth:`close`
    stops accepting and closes every connection (accepting and admission: a
    :class:`.listener.Listener`, owned here).
    """

    def __init__(self, node: Node, host: str = "127.0.0.1", port: int = 0,
                 stats: PlaneStats | None = None, max_connections: int = MAX_CONNECTIONS,
                 frame_timeout: float = FRAME_TIMEOUT, *, max_per_peer: int = MAX_PER_PEER,
                 hello_timeout: float = HELLO_TIMEOUT,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 scratch_bytes: int = SCRATCH_POOL_BYTES,
                 tls: ssl.SSLContext | None = None,
                 dead_peer_timeout: float = DEAD_PEER_TIMEOUT) -> None:
        self.node = node
        self.engine = Engine(node)
        self.host = host
        self.stats = stats if stats is not None else PlaneStats("tcp")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.hello_timeout = hello_timeout
        self.frame_timeout = frame_timeout
        self.dead_peer_timeout = dead_peer_timeout
        self.scratch = ScratchPool(scratch_bytes, SCRATCH_BYTES, self.stats)
        self.tls = tls
        self._listener = Listener(
            (host, port), self._serve, name="tcp", stats=self.stats,
            max_connections=max_connections, max_per_peer=max_per_peer, refusal=_refusal,
            max_setting="tcp_connections_max", per_peer_setting="tcp_connections_per_peer",
            max_unauthenticated=max_unauthenticated,
            unauthenticated_setting="tcp_connections_unauthenticated", backlog=BACKLOG)
        self._port = self._listener.port
        log.info("tcp data plane listening on %s:%d", host, self._port)

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._port

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.set_keepalive(sock, self.dead_peer_timeout)
        if self.tls is None:
            sock.settimeout(0.0)   # non-blocking: the connection polls only when it must wait
            _Connection(self, sock, peer).serve()
            return
        started = time.monotonic()
        stream = tcp_tls.handshake(self.tls, sock, self.hello_timeout, self.stats, peer)
        if stream is None:
            return
        try:
            stream.settimeout(self.frame_timeout)
            conn = _Connection(self, stream, peer)
            conn.hello_deadline = conn.deadline = started + self.hello_timeout
            conn.serve()
        finally:
            stream.close()

    def _closed(self) -> None:
        self.scratch.close()
        log.info("tcp data plane on port %d closed", self._port)


def _refusal(err: SMBError) -> bytes:
    """The unsolicited answer (``req_id`` 0) a refused connection gets."""
    body = str(err).encode()
    return wire.pack_response(error_status(err), 0, len(body)) + body
