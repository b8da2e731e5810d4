"""The TCP data plane: framed requests (see :mod:`smb_protocol.wire`) over a small pool
of connections per memory server, shared by every region of a client. Each connection
presents a region's ticket (``HELLO``) before its first request for that region.
Payloads move between caller buffers and the socket with ``sendmsg``/``recvmsg_into``
on memoryviews, without intermediate copies. A ``tcp+tls://`` endpoint gets the same
session over TLS (:mod:`smb_protocol.tls`): a handshake when each connection opens (the
server checked against the client's CA, the client's certificate presented when it has
one), then OpenSSL encrypts from and decrypts into the same buffers. A refused
handshake raises :class:`AuthenticationError` naming the setting to fix.

Failure detection: a memory server that is gone (host down, link down) is found by the
kernel, not by guessing from the application's silence. Every socket sends TCP
keepalive probes after one idle second and sets ``TCP_USER_TIMEOUT``, so when the peer
acknowledges nothing (neither data nor probes) for ``dead_peer_timeout`` seconds the
connection fails with :class:`ServerUnavailable`, whatever the operation was doing. A
server that is alive but slow (a long accumulate, a lock held by another client) still
acknowledges at the TCP level and is waited for, up to ``io_timeout`` seconds without
progress (then :class:`Timeout`); so is one that keeps its receive window shut while a
request waits for something (Linux would count that as no acknowledgement: requests
are sent with :class:`smb_protocol.wire.PatientSender`, which lifts the user timeout
for as long as the server's window is seen shut).

Retries: a request whose connection broke (reset, closed by the server) runs once more
on another connection when running it again is harmless: a read, or a mutating request
that carries a sequence number (the server answers a repeat with its first answer and
resumes an interrupted accumulate after the bytes that took effect). A request without a
number, or a server that stopped acknowledging altogether, is not retried.
"""
from __future__ import annotations

import errno
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Sequence
from typing import Any

from smb_protocol import wire
from smb_protocol.addressing import Endpoint, format_hostport
from smb_protocol.dtypes import DType
from smb_protocol.errors import (
    InvalidArgument,
    ProtocolError,
    ServerBusy,
    ServerUnavailable,
    SMBError,
    Timeout,
)
from smb_protocol.framing import ClientFrames
from smb_protocol.requests import (
    Arith,
    Arithmetic,
    CompareSwap,
    FetchAdd,
    Lock,
    Pull,
    Push,
    Read,
    Request,
    Wait,
    Write,
)
from smb_protocol.rounds import ChunkRound
from smb_protocol.tls import TLS_SCHEME, TLSConfig, is_trust_failure, untrusted
from smb_protocol.wire import Op, set_dead_peer_timeout

from . import Session, register
from .errors import ConnectionBroken
from .pool import ConnectionPool
from .stream import ReduceStream

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0   # seconds
IO_TIMEOUT = 60.0       # seconds a single send/recv may block
WAIT_CONNECTIONS = 64   # connections per server for waits and locks (each wait holds one)
DEAD_PEER_TIMEOUT = 3.0  # seconds without any TCP acknowledgement before the server is given up
SOCKET_BUFFER = 4 << 20  # bytes
PARTING_TIMEOUT = 0.5   # seconds to read a closing server's parting answer after a failed send
_WORD = struct.Struct("<q")
RETRIES = 1             # extra attempts of a request whose connection broke


class TcpConnection:
    """One socket to a memory server's TCP data plane, and the tickets presented on it."""

    def __init__(self, host: str, port: int, io_timeout: float = IO_TIMEOUT,
                 dead_peer_timeout: float = DEAD_PEER_TIMEOUT, client_id: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.where = f"{TLS_SCHEME if tls is not None else 'tcp'}://{format_hostport(host, port)}"
        try:
            self.sock = socket.create_connection(
                (host, port), timeout=min(CONNECT_TIMEOUT, io_timeout, dead_peer_timeout))
        except OSError as exc:
            raise ServerUnavailable(f"cannot connect to {self.where}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        set_dead_peer_timeout(self.sock, dead_peer_timeout)
        if tls is not None:
            self.sock = self._handshake(tls, host)
        self.dead_peer_timeout = dead_peer_timeout
        self.sock.settimeout(io_timeout)
        self.sender = wire.PatientSender(self.sock, dead_peer_timeout, io_timeout)
        self.client_id = client_id
        self.frames = ClientFrames(self.where)

    def _handshake(self, tls: ssl.SSLContext, host: str) -> ssl.SSLSocket:
        """The TLS client side of the new socket (within the connect timeout); a server
        we do not trust raises AuthenticationError saying which setting to fix."""
        try:
            return tls.wrap_socket(self.sock, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            self.sock.close()
            raise untrusted(self.where, str(exc)) from None
        except OSError as exc:   # ssl.SSLError, a timeout, a reset
            self.sock.close()
            if isinstance(exc, ssl.SSLError) and is_trust_failure(str(exc)):
                raise untrusted(self.where, str(exc)) from None
            if isinstance(exc, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(exc):
                # the plane's only clear-text bytes: its refusal of a connection it cannot take
                raise ServerBusy(f"{self.where}: the memory server refused the connection before "
                                 "the TLS handshake (full: tcp_connections_max or "
                                 "tcp_connections_per_peer, or out of descriptors); retry later "
                                 "or close idle clients") from None
            raise ServerUnavailable(f"{self.where}: TLS handshake failed: {exc} (a full server "
                                    "closes new connections; one that does not serve TLS "
                                    "advertises tcp://)") from None

    def present(self, ticket: str) -> None:
        """Send ``HELLO`` with ``ticket`` unless this connection already did. A refused
        ticket raises its typed error and the server closes the connection."""
        hello = self.frames.hello(ticket)
        if hello is None:
            return
        req_id, frames = hello
        try:
            self._exchange(req_id, frames, ())
        except BaseException:
            self.close()
            raise

    def request(self, req: Request, payload: Sequence[memoryview] = (),
                into: Sequence[memoryview] = ()) -> bytes:
        """Send the typed request ``req`` (its ``payload`` buffers after it) and wait for
        its answer; returns a small answer payload.

        ``into`` receives a READ's payload in place. Socket failures raise
        :class:`ServerUnavailable` (:class:`ConnectionBroken` when the connection failed,
        not the peer) and leave the connection unusable.
        """
        req_id, frames = self.frames.request(req, payload)
        return self._exchange(req_id, frames, into)

    def _exchange(self, req_id: int, frames: Sequence[memoryview | bytes], into: Sequence[memoryview]) -> bytes:
        sent = False
        try:
            self.sender.send(frames)
            sent = True
            answer = self.frames.answer(wire.recv_exact(self.sock, wire.RESPONSE.size))
            self.sender.settled()
            if answer.unsolicited:     # the server refused the connection, then closed it
                refusal = bytes(wire.recv_exact(self.sock, answer.length)) if answer.length else b""
                self.close()
                raise self.frames.error(answer, refusal)
            if answer.req_id != req_id:
                raise self.frames.stray(answer, req_id)
            if answer.ok and into:
                if answer.length != sum(len(b) for b in into):
                    raise ProtocolError(f"{self.where}: read answered {answer.length} bytes")
                wire.recv_into_all(self.sock, into)
                return b""
            body = bytes(wire.recv_exact(self.sock, answer.length)) if answer.length else b""
        except TimeoutError as exc:   # socket.timeout is TimeoutError, and so is ETIMEDOUT
            self.close()
            if exc.errno == errno.ETIMEDOUT:    # the kernel gave up: no acknowledgement at all
                raise ServerUnavailable(f"{self.where}: the server acknowledged nothing for "
                                        f"{self.dead_peer_timeout:g} s (host or link down)") from None
            raise Timeout(f"{self.where}: no answer within {self.sock.gettimeout()} s") from None
        except OSError as exc:
            if isinstance(exc, ssl.SSLError) and (is_trust_failure(str(exc)) or "ALERT" in str(exc)):
                self.close()   # the server refused our certificate (or its absence)
                raise untrusted(self.where, str(exc)) from None
            said = None if sent else self._parting_answer()
            self.close()
            if said is not None:
                raise said from None
            raise ConnectionBroken(f"{self.where}: {exc}") from None
        except ServerBusy:                    # a refusal (answered, then closed): not a break
            raise
        except ServerUnavailable as exc:      # the server closed the connection mid-answer
            self.close()
            raise ConnectionBroken(f"{self.where}: {exc}") from None
        except ProtocolError:
            self.close()
            raise
        if not answer.ok:
            raise self.frames.error(answer, body)
        return body

    def _parting_answer(self) -> SMBError | None:
        """The error a server answered (``req_id`` 0) before it closed this connection,
        when one is there to read (a send failed because the server had closed)."""
        try:
            self.sock.settimeout(PARTING_TIMEOUT)
            answer = self.frames.answer(wire.recv_exact(self.sock, wire.RESPONSE.size))
            if not answer.unsolicited or answer.length > wire.MAX_TICKET:
                return None
            body = bytes(wire.recv_exact(self.sock, answer.length))
        except (OSError, SMBError):
            return None
        return self.frames.error(answer, body)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0


class TcpSession(Session):
    """A pool of up to ``connections`` sockets to one server, shared by every region
    (ticket) of a client.

    Options: ``connections`` (default 2), ``io_timeout`` (seconds one send or receive may
    wait without progress on a live server, default :data:`IO_TIMEOUT`),
    ``dead_peer_timeout`` (seconds without any TCP acknowledgement before the server is
    given up, default :data:`DEAD_PEER_TIMEOUT`: keep it below the controller's lease),
    ``tls`` (a :class:`~smb_protocol.tls.TLSConfig`, used for ``tcp+tls://`` endpoints;
    default ``SMB_TLS_*``). Registered for ``tcp`` and ``tcp+tls``.
    """

    scheme = "tcp"

    def __init__(self, endpoint: Endpoint, options: dict[str, Any] | None = None) -> None:
        options = options or {}
        self.endpoint = endpoint
        self.client_id = int(options.get("client_id", 0))
        self.scheme = endpoint.scheme   # tcp, or tcp+tls
        self.tls: ssl.SSLContext | None = None
        if endpoint.scheme == TLS_SCHEME:   # the client's CA (no CA set: the system's, to fail clearly)
            settings = options.get("tls")
            self.tls = (settings if isinstance(settings, TLSConfig) else TLSConfig.from_env()).client_context()
        self.io_timeout = float(options.get("io_timeout", IO_TIMEOUT))
        self.dead_peer_timeout = float(options.get("dead_peer_timeout", DEAD_PEER_TIMEOUT))
        for name in ("io_timeout", "dead_peer_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds, not {getattr(self, name)}")
        self.pool: ConnectionPool[TcpConnection] = ConnectionPool(
            self._connect, int(options.get("connections", 2)), name=str(endpoint))
        # connections of their own for waits and locks (smb_client.coord): a waiting
        # request holds its connection until it is answered
        self.waits: ConnectionPool[TcpConnection] = ConnectionPool(
            self._connect, int(options.get("wait_connections", WAIT_CONNECTIONS)), name=f"{endpoint} waits")
        self._stream: ReduceStream | None = None
        self._stream_lock = threading.Lock()

    def _connect(self) -> TcpConnection:
        return TcpConnection(self.endpoint.host, self.endpoint.port, self.io_timeout,
                             self.dead_peer_timeout, self.client_id, self.tls)

    def _do(self, ticket: str, req: Request, payload: Sequence[memoryview] = (),
            into: Sequence[memoryview] = (), waits: float | None = None) -> bytes:
        """Run one typed request on a pooled connection; once more on another connection
        when this one broke and the request may run again (a read or a numbered request).
        ``waits``: the request may wait that many seconds at the server, so it goes on a
        connection of the wait pool (whose socket timeout it extends)."""
        repeatable = req.seq != 0 or req.op == wire.Op.READ
        attempt = 0
        while True:
            try:
                with (self.pool if waits is None else self.waits).borrow() as conn:
                    conn.present(ticket)
                    if waits is None:
                        return conn.request(req, payload, into)
                    conn.sock.settimeout(waits + self.io_timeout)
                    try:
                        return conn.request(req, payload, into)
                    finally:
                        if not conn.closed:
                            conn.sock.settimeout(self.io_timeout)
            except ConnectionBroken as exc:
                if not repeatable or attempt >= RETRIES:
                    raise
                attempt += 1
                log.info("%s: %s; sending the request again on another connection", self.endpoint, exc)

    def _word(self, ticket: str, req: Request, waits: float | None = None) -> int:
        """A request answered with an int64 word (atomics, waits, locks)."""
        return int(_WORD.unpack(self._do(ticket, req, waits=waits))[0])

    def write(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
              seq: int = 0) -> None:
        self._do(ticket, Write(Op.WRITE, 0, extent_id, offset, _size(buffers), self.client_id, seq), buffers)

    def read_into(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._do(ticket, Read(Op.READ, 0, extent_id, offset, _size(buffers)), into=buffers)

    def accumulate(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None, seq: int = 0) -> None:
        if alpha is None:
            req = Arithmetic(Op.ACCUMULATE, 0, extent_id, offset, _size(buffers), self.client_id, seq,
                             arith=Arith.ACCUMULATE, dtype=dtype)
        else:
            req = Arithmetic(Op.AXPY, 0, extent_id, offset, _size(buffers), self.client_id, seq,
                             arith=Arith.AXPY, dtype=dtype, alpha=alpha)
        self._do(ticket, req, buffers)

    def scale(self, ticket: str, extent_id: int, offset: int, length: int, dtype: DType, alpha: float,
              seq: int = 0) -> None:
        self._do(ticket, Arithmetic(Op.SCALE, 0, extent_id, offset, length, self.client_id, seq,
                                    arith=Arith.SCALE, dtype=dtype, alpha=alpha))

    def fetch_add(self, ticket: str, extent_id: int, offset: int, value: int, seq: int = 0) -> int:
        return self._word(ticket, FetchAdd(Op.FETCH_ADD, 0, extent_id, offset, 8, self.client_id, seq,
                                           value=value))

    def compare_swap(self, ticket: str, extent_id: int, offset: int, expected: int, desired: int,
                     seq: int = 0) -> int:
        return self._word(ticket, CompareSwap(Op.COMPARE_SWAP, 0, extent_id, offset, 8, self.client_id, seq,
                                              expected=expected, desired=desired))

    def wait(self, ticket: str, extent_id: int, offset: int, cond: int, target: int,
             timeout: float) -> int:
        return self._word(ticket, Wait(Op.WAIT, 0, extent_id, offset, 8, cond=cond, value=target,
                                       timeout=timeout), waits=timeout)

    def lock(self, ticket: str, extent_id: int, offset: int, holder: int, lease: float,
             timeout: float) -> int:
        return self._word(ticket, Lock(Op.LOCK, 0, extent_id, offset, 8, holder=holder, lease=lease,
                                       timeout=timeout), waits=timeout)

    def unlock(self, ticket: str, extent_id: int, offset: int, holder: int) -> int:
        return self._word(ticket, Lock(Op.UNLOCK, 0, extent_id, offset, 8, holder=holder), waits=0.0)

    def push(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview], dtype: int,
             ref: ChunkRound, timeout: float, seq: int = 0) -> int:
        return int(_WORD.unpack(self._do(
            ticket, Push(Op.PUSH, 0, extent_id, offset, _size(buffers), self.client_id, seq, dtype=dtype,
                         ref=ref, timeout=timeout), buffers, waits=timeout))[0])

    def pull(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
             ref: ChunkRound, timeout: float, seq: int = 0, dtype: int = 0, length: int | None = None) -> None:
        n = _size(buffers) if length is None else length
        self._do(ticket, Pull(Op.PULL, 0, extent_id, offset, n, self.client_id, seq, ref=ref,
                              timeout=timeout, dtype=dtype), into=buffers, waits=timeout)

    def reductions(self) -> ReduceStream | None:
        """The pipelined ``REDUCE`` stream to this server (made on first use; one per
        session), or None over TLS (whose collectives push and pull)."""
        if self.tls is not None:
            return None
        with self._stream_lock:
            if self._stream is None:
                self._stream = ReduceStream(self._connect, f"{self.endpoint} (reduce)")
            return self._stream

    def close(self) -> None:
        self.pool.close()
        self.waits.close()
        with self._stream_lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


register("tcp", TcpSession)
register(TLS_SCHEME, TcpSession)


def _size(buffers: Sequence[memoryview]) -> int:
    return sum(len(b) for b in buffers)
