"""The TCP data plane of a memory server (protocol: :mod:`smb_client.wire`).

One accept thread and one thread per connection. A connection presents tickets with
``HELLO`` frames, one per region its client uses here, at any time; each request is
checked against the ticket naming its extent (see :class:`.access.TicketBook`) and the
arena, then served straight between the socket and extent memory: ``READ`` sends from
the mapping with ``sendmsg``, ``WRITE`` receives into it with ``recvmsg_into`` (no
copies); ``ACCUMULATE``/``AXPY`` receive into a per-connection scratch buffer of at
most :data:`SCRATCH_BYTES` and apply the kernel chunk by chunk under the extent's lock.

A request that fails a check is answered with a status code and a UTF-8 message after
its payload was read and discarded, so the connection stays usable. A frame that
breaks the protocol (bad magic, unknown opcode, oversized length, truncated frame, no
``HELLO``) closes that connection only.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from smb_client import wire
from smb_client.dtypes import FLOATING, STORAGE, DType
from smb_client.errors import (
    DtypeError,
    ExtentNotFound,
    InvalidArgument,
    InvalidTicket,
    Misaligned,
    SMBError,
    Status,
    error_status,
)
from smb_client.tickets import verify
from smb_client.wire import Op

from . import kernels
from .access import ACCEPT_POLL, TicketBook, check_access
from .arena import Arena, Extent
from .stats import PlaneStats

log = logging.getLogger(__name__)

# check_access, PlaneStats and ACCEPT_POLL were imported from here before access.py
__all__ = ["TcpPlane", "check_access", "PlaneStats", "ACCEPT_POLL"]

SCRATCH_BYTES = 4 << 20   # bytes of payload received per accumulate step
FRAME_TIMEOUT = 60.0      # seconds a started frame may stall before the connection is dropped
BACKLOG = 128
_OLD = struct.Struct("<q")


class _Drop(Exception):
    """The peer broke the protocol (or went away): close this connection."""


class _Connection:
    """One client socket, its ticket and its scratch buffer. Runs on its own thread."""

    def __init__(self, plane: TcpPlane, sock: socket.socket, peer: str) -> None:
        self.plane = plane
        self.sock = sock
        self.peer = peer
        self.tickets = TicketBook()
        self.pending = 0                      # payload bytes of the current request not yet read
        self._header = bytearray(wire.REQUEST.size)
        self._scratch = bytearray()

    # -- socket helpers -------------------------------------------------------------
    def _scratch_view(self, n: int) -> memoryview:
        if len(self._scratch) < n:
            self._scratch = bytearray(min(SCRATCH_BYTES, max(n, 64 << 10)))
        return memoryview(self._scratch)[:n]

    def _recv_header(self) -> bool:
        """Fill the header buffer; False on a clean close between frames."""
        view = memoryview(self._header)
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if got == 0 and not self.plane.closing:
                    continue  # idle between requests: fine
                raise _Drop("frame stalled") from None
            if n == 0:
                if got == 0:
                    return False
                raise _Drop(f"truncated header ({got} of {len(view)} bytes)")
            got += n
        return True

    def _recv(self, view: memoryview) -> None:
        try:
            wire.recv_into_all(self.sock, [view])
        except (OSError, SMBError) as exc:
            raise _Drop(f"payload: {exc}") from None
        self.pending -= len(view)

    def _drain(self) -> None:
        while self.pending > 0:
            self._recv(self._scratch_view(min(self.pending, SCRATCH_BYTES)))

    def _send(self, buffers: list) -> None:
        try:
            wire.sendmsg_all(self.sock, buffers)
        except OSError as exc:
            raise _Drop(f"send: {exc}") from None

    def _reply(self, req_id: int, body: bytes = b"", status: int = Status.OK) -> None:
        self._send([wire.pack_response(status, req_id, len(body)), body])

    # -- main loop ------------------------------------------------------------------
    def serve(self) -> None:
        try:
            while self._recv_header():
                if not self._request():
                    break
        except _Drop as exc:
            self.plane.stats.add(errors=1)
            log.info("tcp %s: closing connection: %s", self.peer, exc)
        except Exception:
            self.plane.stats.add(errors=1)
            log.exception("tcp %s: unexpected failure; closing connection", self.peer)

    def _request(self) -> bool:
        """Serve one request whose header is in the buffer; False to close the connection.

        Its latency, from the header's arrival to the answer's departure, goes to the
        plane's stats.
        """
        start = time.perf_counter()
        (magic, op_code, dtype, req_id, extent_id, offset, length, arg0, arg1,
         alpha) = wire.REQUEST.unpack(self._header)
        if magic != wire.MAGIC:
            raise _Drop(f"bad magic {magic:#x}")
        try:
            op = Op(op_code)
        except ValueError:
            raise _Drop(f"unknown opcode {op_code}") from None
        if length > wire.MAX_PAYLOAD:
            raise _Drop(f"length {length} exceeds the limit of {wire.MAX_PAYLOAD} bytes")
        self.pending = length if op in wire.PAYLOAD_OPS else 0
        if op is Op.HELLO:
            keep = self._hello(req_id, length)
            self.plane.stats.observe("hello", time.perf_counter() - start)
            return keep
        if not self.tickets:
            raise _Drop(f"{op.name} before HELLO")
        try:
            body = self._dispatch(op, dtype, extent_id, offset, length, arg0, arg1, alpha, req_id)
        except SMBError as exc:
            self._drain()
            self.plane.stats.add(errors=1, operations=1)
            log.debug("tcp %s: %s on extent %d failed: %s", self.peer, op.name, extent_id, exc)
            self._reply(req_id, str(exc).encode(), error_status(exc))
        else:
            if body is not None:   # else already answered (and counted) by the operation
                self.plane.stats.add(operations=1)
                self._reply(req_id, body)
        self.plane.stats.observe(op.name.lower(), time.perf_counter() - start)
        return True

    def _hello(self, req_id: int, length: int) -> bool:
        if length > wire.MAX_TICKET:
            raise _Drop(f"HELLO ticket of {length} bytes exceeds {wire.MAX_TICKET}")
        token = self._scratch_view(length)
        self._recv(token)
        try:
            self.tickets.add(verify(self.plane.secret, bytes(token).decode()))
        except (SMBError, UnicodeDecodeError) as exc:
            err = exc if isinstance(exc, SMBError) else InvalidTicket("ticket is not UTF-8")
            self.plane.stats.add(errors=1)
            log.info("tcp %s: HELLO refused: %s", self.peer, err)
            self._reply(req_id, str(err).encode(), error_status(err))
            return False
        self._reply(req_id)
        return True

    # -- operations -----------------------------------------------------------------
    def _dispatch(self, op: Op, dtype: int, extent_id: int, offset: int, length: int,
                  arg0: int, arg1: int, alpha: float, req_id: int) -> bytes | None:
        """Serve a checked request; returns the OK answer body, or None when already sent."""
        if op is Op.PING:
            return b""
        extent = self.tickets.check(self.plane.arena, extent_id, write=op in wire.WRITE_OPS)
        extent.check_range(offset, length)
        if op is Op.READ:
            return self._read(extent, offset, length, req_id)
        if op is Op.WRITE:
            return self._write(extent, offset, length)
        if op in (Op.FETCH_ADD, Op.COMPARE_SWAP):
            return self._atomic(op, extent, offset, length, arg0, arg1)
        dt = kernels.element_type(dtype)
        if op is not Op.ACCUMULATE and dt not in FLOATING:
            raise DtypeError(f"{op.name.lower()} needs a floating element type, "
                                     f"not {dt.name.lower()}")
        size = STORAGE[dt].itemsize
        if offset % size or length % size:
            raise Misaligned(f"offset {offset} and length {length} must be multiples of the "
                             f"{dt.name.lower()} element size ({size} bytes)")
        if op is Op.SCALE:
            return self._scale(extent, offset, length, dt, alpha)
        return self._accumulate(extent, offset, length, dt, alpha if op is Op.AXPY else None)

    def _read(self, extent: Extent, offset: int, length: int, req_id: int) -> None:
        with extent.pin():
            with extent.data[offset:offset + length] as view:
                # counted before the answer goes out, so a client that has it sees the count
                self.plane.stats.add(bytes_read=length, operations=1)
                self._send([wire.pack_response(Status.OK, req_id, length), view])
        return None

    def _write(self, extent: Extent, offset: int, length: int) -> bytes:
        with extent.pin():
            with extent.data[offset:offset + length] as view:
                self._recv(view)
            if not extent.live:
                raise ExtentNotFound(f"extent {extent.extent_id} was released during the write")
        self.plane.stats.add(bytes_written=length)
        return b""

    def _accumulate(self, extent: Extent, offset: int, length: int, dt: DType,
                    alpha: float | None) -> bytes:
        with extent.pin():
            pos, end = offset, offset + length
            while pos < end:
                n = min(end - pos, SCRATCH_BYTES)
                chunk = self._scratch_view(n)
                self._recv(chunk)
                with extent.lock, extent.data[pos:pos + n] as dst:
                    if alpha is None:
                        kernels.accumulate(dst, chunk, dt)
                    else:
                        kernels.axpy(dst, alpha, chunk, dt)
                pos += n
            if not extent.live:
                raise ExtentNotFound(f"extent {extent.extent_id} was released during the operation")
        self.plane.stats.add(bytes_accumulated=length)
        return b""

    def _scale(self, extent: Extent, offset: int, length: int, dt: DType, alpha: float) -> bytes:
        with extent.pin():
            pos, end = offset, offset + length
            while pos < end:
                n = min(end - pos, SCRATCH_BYTES)
                with extent.lock, extent.data[pos:pos + n] as dst:
                    kernels.scale(dst, alpha, dt)
                pos += n
        return b""

    def _atomic(self, op: Op, extent: Extent, offset: int, length: int, arg0: int, arg1: int) -> bytes:
        if length != 8:
            raise InvalidArgument(f"{op.name.lower()} works on one 8-byte word, not {length} bytes")
        if offset % 8:
            raise Misaligned(f"{op.name.lower()} needs an 8-byte aligned offset, not {offset}")
        with extent.pin(), extent.lock, extent.data[offset:offset + 8] as word:
            if op is Op.FETCH_ADD:
                old = kernels.fetch_add(word, arg0)
            else:
                old = kernels.compare_swap(word, arg0, arg1)
        return _OLD.pack(old)


class TcpPlane:
    """Listens on ``host:port`` (0: any free port) and serves the TCP data plane.

    Borrows ``arena`` (not closed here); ``secret`` verifies tickets; ``stats`` (a
    :class:`PlaneStats`, shared with other planes) receives counters. Starts serving
    on construction; :meth:`close` stops accepting and closes every connection.
    """

    def __init__(self, arena: Arena, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 stats: PlaneStats | None = None, max_connections: int = 1024,
                 frame_timeout: float = FRAME_TIMEOUT) -> None:
        self.arena = arena
        self.secret = secret
        self.host = host
        self.stats = stats if stats is not None else PlaneStats("tcp")
        self.max_connections = max_connections
        self.frame_timeout = frame_timeout
        self.closing = False
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(BACKLOG)
            self._listener.settimeout(ACCEPT_POLL)
        except BaseException:
            self._listener.close()
            raise
        self._port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self._port}",
                                        daemon=True)
        self._thread.start()
        log.info("tcp data plane listening on %s:%d", host, self._port)

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._port

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self.closing:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self.closing:
                    log.warning("tcp accept failed: %s", exc)
                    time.sleep(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full and not self.closing:
                    thread = threading.Thread(target=self._serve, args=(sock, peer),
                                              name=f"tcp-{peer}", daemon=True)
                    self._conns[sock] = thread
            if full or self.closing:
                log.warning("tcp %s: refused: %d connections open (the limit)", peer, self.max_connections)
                sock.close()
                continue
            thread.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        self.stats.add(sessions=1)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.frame_timeout)
            log.debug("tcp %s: connected", peer)
            _Connection(self, sock, peer).serve()
        except OSError as exc:
            log.info("tcp %s: %s", peer, exc)
        finally:
            self.stats.add(sessions=-1)
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()
            log.debug("tcp %s: closed", peer)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, wait for their threads (seconds)."""
        if self.closing:
            return
        self.closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _thread in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        for _sock, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        log.info("tcp data plane on port %d closed", self._port)

    def __enter__(self) -> TcpPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
