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

The module is longer than 400 lines on purpose: a connection's framing, its deadlines
and the copy-free paths of every operation share one socket and one set of rules, and
read best together; accepting and admission live in :mod:`.listener`. The same holds
for the mutations of replicated extents (:mod:`.replication`): a primary receives,
applies and forwards each piece on the connection's thread, and a backup serves the
pieces a primary forwards with the connection's framing and dedup table; the replica
configuration and the forwarding connections live in :mod:`.replication`.

Replicated extents: a mutation on a connection that presented a ``replica`` ticket for
its extent is a piece forwarded by a primary (:meth:`_Connection._piece`, format in
:mod:`smb_protocol.wire`); a client's mutation of a primary is received into scratch
(writes too) and applied and forwarded piece by piece under the extent's lock
(:meth:`_Connection._replicated`), then answered once no backup is marked failed; a
client's mutation of a backup, and PUSH/PULL on any replicated extent, are refused.
"""
from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from smb_protocol import wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import (
    ExtentNotFound,
    InvalidArgument,
    InvalidTicket,
    Misaligned,
    NotPrimary,
    ServerError,
    SMBError,
    Status,
    Timeout,
    error_status,
)
from smb_protocol.tickets import TicketMode, verify
from smb_protocol.wire import Op

from . import coord_ops, kernels, replication, waiters
from .access import TicketBook
from .arena import Arena, Extent
from .dedup import DedupTable, Entry, unpack_records
from .kernels import Arith
from .listener import BACKLOG, Listener
from .stats import PlaneStats

log = logging.getLogger(__name__)


SCRATCH_BYTES = 4 << 20   # bytes of payload received per accumulate step (one pooled buffer)
SMALL_SCRATCH = 64 << 10  # bytes; payloads up to this use a buffer of their own, dropped after use
SCRATCH_POOL_BYTES = 64 << 20  # bytes of pooled scratch buffers a plane may hold in all
SCRATCH_KEEP = 2          # idle pooled buffers kept for reuse; the others are freed
HELLO_TIMEOUT = 5.0       # seconds from accept to the end of the first HELLO
FRAME_TIMEOUT = 60.0      # seconds from a frame's first byte to its last
MAX_CONNECTIONS = 1024    # connections open at once
MAX_PER_PEER = 128        # connections open at once from one peer address
MAX_UNAUTHENTICATED = 256  # connections open at once without a valid HELLO yet (one more evicts one)
GOODBYE_LINGER = 1.0      # seconds a dropped connection with a ticket is read (and discarded)
                          # after its parting answer, so that the close is no reset
_FRAME_HINT = ("a slow or stalled client: raise tcp_frame_timeout_seconds on the memory server "
               "for slow links")
_OLD = struct.Struct("<q")
_ARITH = {Op.ACCUMULATE: Arith.ACCUMULATE, Op.AXPY: Arith.AXPY, Op.SCALE: Arith.SCALE}


class _Repeat(Exception):
    """A retry of a numbered request whose first attempt failed: its first answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body


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


class ScratchPool:
    """Scratch buffers of ``chunk`` bytes lent to connections for one request each; at
    most ``limit`` bytes of them exist at once (at least one buffer), and at most
    :data:`SCRATCH_KEEP` idle ones are kept. ``stats`` counts them (see
    :data:`.stats.LIMIT_COUNTS`). Thread-safe.
    """

    def __init__(self, limit: int = SCRATCH_POOL_BYTES, chunk: int = SCRATCH_BYTES,
                 stats: PlaneStats | None = None) -> None:
        self.chunk = chunk
        self.limit = max(int(limit), chunk)
        self.stats = stats if stats is not None else PlaneStats("tcp")
        self.allocated = 0           # bytes
        self._idle: list[bytearray] = []
        self._cond = threading.Condition()

    def acquire(self, deadline: float) -> bytearray:
        """A buffer of :attr:`chunk` bytes; waits for one until ``deadline`` (a
        :func:`time.monotonic` time), then raises TimeoutError."""
        with self._cond:
            waited = False
            while not self._idle and self.allocated + self.chunk > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no scratch buffer free ({self.allocated} bytes lent)")
                if not waited:
                    self.stats.add(scratch_waits=1)
                    waited = True
                self._cond.wait(left)
            if self._idle:
                buf = self._idle.pop()
            else:
                buf = bytearray(self.chunk)
                self.allocated += self.chunk
                self.stats.add(scratch_bytes=self.chunk)
        self.stats.add(scratch_in_use=1)
        return buf

    def release(self, buf: bytearray) -> None:
        """Give a buffer from :meth:`acquire` back."""
        self.stats.add(scratch_in_use=-1)
        with self._cond:
            if len(self._idle) < SCRATCH_KEEP:
                self._idle.append(buf)
            else:
                self.allocated -= len(buf)
                self.stats.add(scratch_bytes=-len(buf))
            self._cond.notify()

    def close(self) -> None:
        """Free the idle buffers."""
        with self._cond:
            freed = sum(len(b) for b in self._idle)
            self._idle.clear()
            self.allocated -= freed
        if freed:
            self.stats.add(scratch_bytes=-freed)


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
                self.sock.settimeout(left)
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if self.plane.closing:
                    return False
                if deadline is None:
                    continue  # idle between requests: fine
                self.plane.stats.add(dropped=1)
                if hello:
                    raise _Drop(f"no HELLO within {self.plane.hello_timeout:g} s of connecting "
                                "(tcp_hello_timeout_seconds)", Timeout,
                                "present a ticket right after connecting") from None
                raise _Drop(f"frame not complete within {self.plane.frame_timeout:g} s "
                            "(tcp_frame_timeout_seconds)", Timeout, _FRAME_HINT) from None
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

    def _recv(self, view: memoryview) -> None:
        try:
            wire.recv_into_all(self.sock, [view], deadline=self.deadline)
        except TimeoutError:
            self.plane.stats.add(dropped=1)
            raise _Drop(f"frame not complete within {self.plane.frame_timeout:g} s "
                        "(tcp_frame_timeout_seconds)", Timeout, _FRAME_HINT) from None
        except (OSError, SMBError) as exc:
            raise _Drop(f"payload: {exc}") from None
        self.pending -= len(view)

    def _drain(self) -> None:
        if self.pending <= 0:
            return
        with self._scratch(self.pending) as scratch:
            while self.pending > 0:
                self._recv(scratch[:min(self.pending, len(scratch))])

    def _send(self, buffers: list[memoryview | bytes]) -> None:
        try:
            self.sock.settimeout(self.plane.frame_timeout)
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
        """Send ``err`` as the parting answer (``req_id`` 0) when the socket takes it at
        once, stop sending, then read and discard what the peer still sends, for up to
        :data:`GOODBYE_LINGER` seconds if it has presented a ticket, so that the close
        does not reset the answer away."""
        body = str(err).encode()
        linger = GOODBYE_LINGER if self.tickets else 0.0
        try:
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
            if op is Op.SEED:
                body = self._seed(extent_id, length)
            elif op is Op.PULL:
                body = self._pull(client, seq, extent_id, offset, length, arg0, arg1, alpha, req_id)
            elif op in wire.WRITE_OPS and self._forwarded(extent_id):
                body = self._piece(client, seq, op, dtype, extent_id, offset, length, arg0, arg1, alpha)
            elif seq and op in wire.WRITE_OPS:
                body = self._once(client, seq, op, dtype, extent_id, offset, length, arg0, arg1, alpha)
            else:
                body = self._dispatch(op, dtype, extent_id, offset, length, arg0, arg1, alpha, req_id)
        except _Repeat as rep:           # a retry of a request that failed the first time
            self._drain()
            self.plane.stats.add(errors=1, operations=1)
            self._reply(req_id, rep.body, rep.status)
        except SMBError as exc:
            self._drain()
            self.plane.stats.add(errors=1, operations=1)
            log.debug("tcp %s: %s on extent %d failed: %s", self.peer, op.name, extent_id, exc)
            self._reply(req_id, str(exc).encode(), error_status(exc))
        else:
            if op in wire.WRITE_OPS:   # wake the waits on the words it changed
                waiters.for_arena(self.plane.arena).touched(extent_id, offset, length)
            if body is not None:   # else already answered (and counted) by the operation
                self.plane.stats.add(operations=1)
                self._reply(req_id, body)
        self.plane.stats.observe(op.name.lower(), time.perf_counter() - start)
        return True

    def _hello(self, req_id: int, length: int) -> bool:
        if length > wire.MAX_TICKET:
            raise _Drop(f"HELLO ticket of {length} bytes exceeds {wire.MAX_TICKET}")
        with self._scratch(length) as token:
            self._recv(token)
            raw = bytes(token)
        try:
            self.tickets.add(verify(self.plane.secret, raw.decode()))
            self.plane._listener.current().authenticated()   # counted from now on (listener.py)
        except (SMBError, UnicodeDecodeError) as exc:
            err = exc if isinstance(exc, SMBError) else InvalidTicket("ticket is not UTF-8")
            self.plane.stats.add(errors=1)
            log.info("tcp %s: HELLO refused: %s", self.peer, err)
            self._reply(req_id, str(err).encode(), error_status(err))
            return False
        self._reply(req_id)
        return True

    # -- operations -----------------------------------------------------------------
    def _once(self, client: int, seq: int, op: Op, dtype: int, extent_id: int, offset: int,
              length: int, arg0: int, arg1: int, alpha: float) -> bytes:
        """Serve a numbered mutating request at most once (see :mod:`.dedup`).

        The ticket and range are checked first and on every attempt (a retry under a
        renewed ticket passes). A repeat of a finished request gets the first answer and
        its payload is discarded; a repeat of an interrupted one resumes after the bytes
        that took effect. A failure before anything took effect (for example a ticket
        that expired) is not remembered, so the retry runs the request.
        """
        extent = self.tickets.check(self.plane.arena, extent_id, write=True)
        extent.check_range(offset, length)
        what = (int(op), extent_id, offset, length, dtype)
        fresh, entry, body = self.plane.dedup.once(
            client, seq, what, self.plane.frame_timeout,
            lambda entry: self._dispatch(op, dtype, extent_id, offset, length, arg0, arg1, alpha, 0, entry,
                                         client, seq))
        if not fresh:
            self.plane.stats.add(repeats=1)
            if entry.status != Status.OK:
                raise _Repeat(entry.status, entry.body)
            self._drain()
            return entry.body
        return body

    def _dispatch(self, op: Op, dtype: int, extent_id: int, offset: int, length: int,
                  arg0: int, arg1: int, alpha: float, req_id: int,
                  entry: Entry | None = None, client: int = 0, seq: int = 0) -> bytes | None:
        """Serve a checked request; returns the OK answer body, or None when already sent.
        ``entry`` (a numbered request ``seq`` of ``client``) counts the payload bytes that
        took effect and, on a resumed attempt, says how many to skip."""
        if op is Op.PING:
            return b""
        extent = self.tickets.check(self.plane.arena, extent_id, write=op in wire.WRITE_OPS)
        extent.check_range(offset, length)
        if op in wire.WRITE_OPS and self.plane.replication.role(extent_id):
            return self._replicated(op, extent, offset, length, dtype, arg0, arg1, alpha, client, seq, entry)
        if op in wire.COORD_OPS:
            return coord_ops.serve(waiters.for_arena(self.plane.arena), op, extent, offset, length, dtype,
                                   arg0, arg1, alpha, self._cancelled)
        if op is Op.PUSH:
            return self._push(extent, offset, length, dtype, arg0, arg1, alpha, entry)
        if op is Op.READ:
            self._read(extent, offset, length, req_id)
            return None
        if op is Op.WRITE:
            return self._write(extent, offset, length)
        if op in (Op.FETCH_ADD, Op.COMPARE_SWAP):
            return self._atomic(op, extent, offset, length, arg0, arg1)
        arith = _ARITH.get(op)
        if arith is None:
            raise InvalidArgument(f"{op.name.lower()} is not served on the tcp data plane")
        dt = kernels.check_arith(arith, dtype, offset, length)
        if arith is Arith.SCALE:
            return self._scale(extent, offset, length, dt, alpha)
        return self._accumulate(extent, offset, length, dt, arith, alpha, entry)

    # -- collectives (smb_client/collective.py) -------------------------------------------
    def _chunk_word(self, op: Op, extent: Extent, offset: int, length: int, word: int) -> None:
        if length > wire.MAX_CHUNK:
            raise InvalidArgument(f"{op.name.lower()} moves at most {wire.MAX_CHUNK} bytes, not {length}")
        if word % 8:
            raise Misaligned(f"{op.name.lower()}: count word offset {word} is not 8-byte aligned")
        extent.check_range(word, 8)
        if word < offset + length and offset < word + 8:
            raise InvalidArgument(f"{op.name.lower()}: count word at {word} overlaps the chunk "
                                  f"[{offset}, {offset + length})")

    def _cancelled(self) -> bool:
        """Whether a waiting request should stop: the plane closes or the peer left."""
        return self.plane.closing or coord_ops.peer_closed(self.sock)

    def _push(self, extent: Extent, offset: int, length: int, dtype: int, word: int, base: int,
              timeout: float, entry: Entry | None) -> bytes:
        """Receive the chunk whole, wait until the count reaches ``base``, then under the
        extent's lock store it (the round's first arrival: count == base) or add it,
        and count the arrival. The decision and the count change under one lock, so
        concurrent pushes of a round never lose a contribution."""
        self._chunk_word(Op.PUSH, extent, offset, length, word)
        dt = kernels.check_arith(Arith.ACCUMULATE, dtype, offset, length)
        table = waiters.for_arena(self.plane.arena)
        with extent.pin(), self._scratch(max(length, 1)) as scratch:
            chunk = scratch[:length]
            self._recv(chunk)
            table.wait(extent, word, wire.WaitCond.AT_LEAST, base, timeout, self._cancelled)
            with extent.lock, extent.data[offset:offset + length] as dst, \
                    extent.data[word:word + 8] as count:
                old = kernels.fetch_add(count, 0)
                if old == base:
                    dst[:] = chunk
                else:
                    kernels.apply(Arith.ACCUMULATE, dst, chunk, dt, 0.0)
                # counted after the sum is in place: a pull reads once the count says so,
                # without the lock
                kernels.fetch_add(count, 1)
                if entry is not None:
                    entry.applied = max(length, 1)
        if not extent.live:
            raise ExtentNotFound(f"extent {extent.extent_id} was released during the push")
        table.touched(extent.extent_id, word, 8)
        self.plane.stats.add(bytes_accumulated=length)
        return _OLD.pack(old)

    def _pull(self, client: int, seq: int, extent_id: int, offset: int, length: int, word: int,
              target: int, timeout: float, req_id: int) -> None:
        """Wait until the count reaches ``target``, send the chunk, then count the pull
        (once per numbered request: a repeat gets the bytes again and counts nothing)."""
        extent = self.tickets.check(self.plane.arena, extent_id, write=True)
        extent.check_range(offset, length)
        if self.plane.replication.role(extent_id):
            raise InvalidArgument(f"pull: extent {extent_id} is replicated; collectives use regions "
                                  "of their own")
        self._chunk_word(Op.PULL, extent, offset, length, word)
        table = waiters.for_arena(self.plane.arena)

        def run(entry: Entry | None) -> None:
            table.wait(extent, word, wire.WaitCond.AT_LEAST, target, timeout, self._cancelled)
            self._read(extent, offset, length, req_id)   # in the socket's buffer once this returns
            with extent.pin(), extent.lock, extent.data[word:word + 8] as count:
                kernels.fetch_add(count, 1)
        if not seq:
            run(None)
        else:
            fresh, _, _ = self.plane.dedup.once(client, seq, (int(Op.PULL), extent_id, offset, length, word),
                                                self.plane.frame_timeout, run)
            if not fresh:
                self.plane.stats.add(repeats=1)
                self._read(extent, offset, length, req_id)
                return None
        table.touched(extent_id, word, 8)
        return None

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

    def _accumulate(self, extent: Extent, offset: int, length: int, dt: DType, arith: Arith,
                    alpha: float, entry: Entry | None = None) -> bytes:
        """Receive the operand chunk by chunk and apply each under the extent's lock. A
        resumed attempt (``entry.applied`` > 0) reads and discards the bytes that took
        effect before and applies the rest; ``entry.applied`` grows as chunks apply."""
        with extent.pin():
            pos, end = offset, offset + length
            with self._scratch(length) as scratch:
                skip = entry.applied if entry is not None else 0
                while skip:
                    n = min(skip, len(scratch))
                    self._recv(scratch[:n])
                    skip -= n
                    pos += n
                while pos < end:
                    n = min(end - pos, len(scratch))
                    chunk = scratch[:n]
                    self._recv(chunk)
                    with extent.lock, extent.data[pos:pos + n] as dst:
                        kernels.apply(arith, dst, chunk, dt, alpha)
                        if entry is not None:
                            entry.applied += n
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
                    kernels.apply(Arith.SCALE, dst, None, dt, alpha)
                pos += n
        return b""

    def _atomic(self, op: Op, extent: Extent, offset: int, length: int, arg0: int, arg1: int) -> bytes:
        _check_word(op, offset, length)
        with extent.pin(), extent.lock:
            return self._atomic_locked(op, extent, offset, arg0, arg1)

    @staticmethod
    def _atomic_locked(op: Op, extent: Extent, offset: int, arg0: int, arg1: int) -> bytes:
        with extent.data[offset:offset + 8] as word:
            if op is Op.FETCH_ADD:
                old = kernels.fetch_add(word, arg0)
            else:
                old = kernels.compare_swap(word, arg0, arg1)
        return _OLD.pack(old)

    # -- replicated extents (see .replication) ------------------------------------------
    def _forwarded(self, extent_id: int) -> bool:
        """Whether this connection presented a replica ticket for the extent: its
        mutations are pieces forwarded by a primary."""
        ticket = self.tickets.get(extent_id)
        return ticket is not None and ticket.mode is TicketMode.REPLICA

    def _primary(self, extent: Extent) -> replication.ReplicaConfig:
        """The extent's configuration, read under its lock; NotPrimary unless it is a primary."""
        cfg = self.plane.replication.config(extent.extent_id)
        if cfg is None or cfg.role != "primary":
            role = cfg.role if cfg is not None and cfg.role else "not replicated"
            raise NotPrimary(f"extent {extent.extent_id} is {role} here, not a primary: open the "
                             "region again and send mutations to its primary")
        return cfg

    def _replicated(self, op: Op, extent: Extent, offset: int, length: int, dtype: int, arg0: int,
                    arg1: int, alpha: float, client: int, seq: int, entry: Entry | None) -> bytes:
        """A client's mutation of a replicated extent: on a primary, applied piece by piece
        and each piece forwarded to the backups under the extent's lock, answered once no
        backup is marked failed; on a backup, NotPrimary."""
        if self.plane.replication.role(extent.extent_id) != "primary":
            self._primary(extent)   # raises NotPrimary
        if op not in replication.REPLICATED_OPS:
            raise InvalidArgument(f"{op.name.lower()} is not served on replicated extent "
                                  f"{extent.extent_id} (collectives use regions of their own)")
        with extent.pin():
            if op in replication.RANGED_OPS:
                body = self._replicate_range(op, extent, offset, length, dtype, alpha, client, seq, entry)
            elif op in wire.COORD_OPS:
                body = self._replicate_lock(op, extent, offset, length, dtype, arg0, arg1, alpha,
                                            client, seq, entry)
            else:
                _check_word(op, offset, length)
                with extent.lock:
                    cfg = self._primary(extent)
                    if entry is not None and entry.applied:
                        body = entry.body     # applied and forwarded by an earlier attempt
                    else:
                        body = self._atomic_locked(op, extent, offset, arg0, arg1)
                        if entry is not None:
                            entry.applied, entry.body = 8, body
                        self.plane.replication.forward(extent, cfg, op, offset, 8, dtype, arg0, arg1,
                                                       alpha, client, seq)
        self.plane.replication.settle(extent.extent_id)
        if not extent.live:
            raise ExtentNotFound(f"extent {extent.extent_id} was released during the operation")
        return body

    def _replicate_range(self, op: Op, extent: Extent, offset: int, length: int, dtype: int,
                         alpha: float, client: int, seq: int, entry: Entry | None) -> bytes:
        """WRITE, ACCUMULATE, AXPY, SCALE on a primary: received into scratch (writes too,
        so that they are ordered with the rest), applied and forwarded piece by piece
        under the extent's lock. Bytes an earlier attempt applied here (``entry.applied``)
        are neither applied nor forwarded again: every backup in the set got them when they
        were applied (or was marked failed, and is dropped), and a copy that joined later
        was filled from this one, which holds them, so forwarding them again would apply
        them twice there (its exactly-once table never saw the request)."""
        arith = _ARITH.get(op)
        dt = kernels.check_arith(arith, dtype, offset, length) if arith is not None else None
        done = entry.applied if entry is not None else 0
        payload = op in wire.PAYLOAD_OPS
        pos, end = offset, offset + length
        with self._scratch(length) if payload else nullcontext(None) as scratch:
            step = len(scratch) if scratch is not None else SCRATCH_BYTES
            while pos < end:
                n = min(end - pos, step)
                chunk = scratch[:n] if scratch is not None else None
                if chunk is not None:
                    self._recv(chunk)
                with extent.lock:
                    cfg = self._primary(extent)
                    first = max(pos, offset + done)
                    if first < pos + n:
                        with extent.data[first:pos + n] as dst:
                            src = chunk[first - pos:] if chunk is not None else None
                            if arith is None:
                                dst[:] = src
                            else:
                                assert dt is not None
                                kernels.apply(arith, dst, src, dt, alpha)
                        if entry is not None:
                            entry.applied = pos + n - offset
                        self.plane.replication.forward(
                            extent, cfg, op, first, pos + n - first, dtype, offset, length, alpha,
                            client, seq, [chunk[first - pos:]] if chunk is not None else [])
                pos += n
        if op is Op.WRITE:
            self.plane.stats.add(bytes_written=length)
        elif op is not Op.SCALE:
            self.plane.stats.add(bytes_accumulated=length)
        return b""

    def _replicate_lock(self, op: Op, extent: Extent, offset: int, length: int, dtype: int, arg0: int,
                        arg1: int, alpha: float, client: int, seq: int, entry: Entry | None) -> bytes:
        """LOCK/UNLOCK on a primary: served as usual; once the word changed (under the
        extent's lock) it goes to the backups as a piece: arg0 the new word, arg1 the answer."""
        repl = self.plane.replication
        new = arg0 if op is Op.LOCK else 0
        if entry is not None and entry.applied:   # taken and forwarded by an earlier attempt
            self._primary(extent)
            return entry.body

        def applied(before: int) -> None:
            cfg = self._primary(extent)
            if entry is not None:
                entry.applied, entry.body = 8, _OLD.pack(before)
            repl.forward(extent, cfg, op, offset, 8, dtype, new, before, alpha, client, seq)

        return coord_ops.serve(waiters.for_arena(self.plane.arena), op, extent, offset, length, dtype,
                               arg0, arg1, alpha, self._cancelled, applied)

    def _piece(self, client: int, seq: int, op: Op, dtype: int, extent_id: int, offset: int,
               length: int, arg0: int, arg1: int, alpha: float) -> bytes:
        """A piece a primary forwarded (this connection presented a replica ticket), filed
        under the client request it belongs to (:func:`.replication.piece_what`): its bytes
        up to ``entry.applied`` are skipped, the rest applied; the entry is finished once
        the whole request is in. A piece that starts after a fresh entry's first byte
        belongs to a request that began before this backup joined (its copy brings the
        start); a gap in a started one is refused."""
        ticket = self.tickets.get(extent_id)
        assert ticket is not None
        extent = self.tickets.check(self.plane.arena, extent_id, write=True)
        extent.check_range(offset, length)
        self.plane.replication.admit_piece(ticket, extent_id)
        if op not in replication.REPLICATED_OPS:
            raise InvalidArgument(f"{op.name.lower()} is not forwarded to replicas")
        with extent.pin():
            if not seq:
                return self._apply_piece(op, extent, offset, length, dtype, arg0, arg1, alpha, 0)
            what, start, end = replication.piece_what(op, extent_id, offset, length, dtype, arg0, arg1)
            try:
                fresh, entry = self.plane.dedup.begin(client, seq, self.plane.frame_timeout, what)
            except TimeoutError as exc:
                raise Timeout(f"{exc}: retry later") from None
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if not fresh:
                self.plane.stats.add(repeats=1)
                self._drain()
                return b""
            try:
                if entry.applied == 0:
                    entry.applied = start
                if entry.applied < start:
                    raise InvalidArgument(f"piece [{start}, {end}) of request {seq} of client {client:#x}: "
                                          f"only {entry.applied} bytes of it arrived before")
                body = self._apply_piece(op, extent, offset, length, dtype, arg0, arg1, alpha,
                                         min(entry.applied, end) - start)
                entry.applied = max(entry.applied, end)
            except BaseException:
                self.plane.dedup.interrupt(entry)
                raise
            if entry.applied >= what[3]:
                entry.finish(Status.OK, body)
            else:
                self.plane.dedup.interrupt(entry)   # the next piece continues it
        return body

    def _seed(self, extent_id: int, length: int) -> bytes:
        """The exactly-once entries a primary hands this copy after filling it (over its
        replica ticket, at the current view): taken where this table has none."""
        if not self._forwarded(extent_id):
            raise InvalidArgument("exactly-once entries are taken from a primary only (replica ticket)")
        ticket = self.tickets.get(extent_id)
        assert ticket is not None
        self.tickets.check(self.plane.arena, extent_id, write=True)
        self.plane.replication.admit_piece(ticket, extent_id)
        payload = bytearray(length)
        self._recv(memoryview(payload))
        # filed under this copy's extent id, which a retry at this copy names
        records = [(client, seq, (what[0], extent_id, *what[2:]), applied, done, status, body)
                   for client, seq, what, applied, done, status, body in unpack_records(payload)]
        taken = self.plane.dedup.seed(records)
        log.debug("extent %d: %d of %d exactly-once entries taken from the primary", extent_id, taken,
                  len(records))
        return b""

    def _apply_piece(self, op: Op, extent: Extent, offset: int, length: int, dtype: int, arg0: int,
                     arg1: int, alpha: float, skip: int) -> bytes:
        """Apply a forwarded piece, after its first ``skip`` bytes (received and dropped)."""
        if op in (Op.FETCH_ADD, Op.COMPARE_SWAP):
            return self._atomic(op, extent, offset, length, arg0, arg1)
        if op in wire.COORD_OPS:   # LOCK/UNLOCK: store the primary's word, answer its answer
            _check_word(op, offset, length)
            with extent.lock, extent.data[offset:offset + 8] as word:
                _OLD.pack_into(word, 0, arg0)
            return _OLD.pack(arg1)
        arith = _ARITH.get(op)
        dt = kernels.check_arith(arith, dtype, offset, length) if arith is not None else None
        if op is Op.SCALE:
            assert dt is not None
            if skip < length:
                with extent.lock, extent.data[offset + skip:offset + length] as dst:
                    kernels.apply(Arith.SCALE, dst, None, dt, alpha)
            return b""
        with self._scratch(length) as scratch:
            pos = 0
            while pos < length:
                n = min(length - pos, len(scratch))
                chunk = scratch[:n]
                self._recv(chunk)
                first = max(pos, skip)
                if first < pos + n:
                    with extent.lock, extent.data[offset + first:offset + pos + n] as dst:
                        if arith is None:
                            dst[:] = chunk[first - pos:]
                        else:
                            assert dt is not None
                            kernels.apply(arith, dst, chunk[first - pos:], dt, alpha)
                pos += n
        return b""


def _check_word(op: Op, offset: int, length: int) -> None:
    if length != 8:
        raise InvalidArgument(f"{op.name.lower()} works on one 8-byte word, not {length} bytes")
    if offset % 8:
        raise Misaligned(f"{op.name.lower()} needs an 8-byte aligned offset, not {offset}")


class TcpPlane:
    """Listens on ``host:port`` (0: any free port) and serves the TCP data plane.

    Borrows ``arena`` (not closed here); ``secret`` verifies tickets; ``stats`` (a
    :class:`PlaneStats`, shared with other planes) receives counters. Limits (see the
    module docstring): ``max_connections`` in all, ``max_per_peer`` from one peer
    address, ``hello_timeout`` and ``frame_timeout`` (seconds), ``scratch_bytes`` of
    pooled scratch buffers. Starts serving on construction; :meth:`close` stops
    accepting and closes every connection. Accepting and admission are a
    :class:`.listener.Listener`'s, owned here.
    """

    def __init__(self, arena: Arena, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 stats: PlaneStats | None = None, max_connections: int = MAX_CONNECTIONS,
                 frame_timeout: float = FRAME_TIMEOUT, *, max_per_peer: int = MAX_PER_PEER,
                 hello_timeout: float = HELLO_TIMEOUT,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 scratch_bytes: int = SCRATCH_POOL_BYTES,
                 dedup: DedupTable | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.arena = arena
        self.secret = secret
        self.host = host
        self.stats = stats if stats is not None else PlaneStats("tcp")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.hello_timeout = hello_timeout
        self.frame_timeout = frame_timeout
        self.scratch = ScratchPool(scratch_bytes, SCRATCH_BYTES, self.stats)
        self.dedup = dedup if dedup is not None else DedupTable()
        self.tls = tls
        self.replication = replication.for_arena(arena, secret)
        if self.replication.dedup is None:   # a sync hands a new copy this server's entries
            self.replication.dedup = self.dedup
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

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return self._listener.connections

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._listener.closing

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is None:
            sock.settimeout(self.frame_timeout)
            _Connection(self, sock, peer).serve()
            return
        started = time.monotonic()
        stream = self._handshake(sock, peer)
        if stream is None:
            return
        try:
            stream.settimeout(self.frame_timeout)
            conn = _Connection(self, stream, peer)
            conn.hello_deadline = conn.deadline = started + self.hello_timeout
            conn.serve()
        finally:
            stream.close()

    def _handshake(self, sock: socket.socket, peer: str) -> ssl.SSLSocket | None:
        """The TLS server side of ``sock``, after a handshake that must end within
        ``hello_timeout`` seconds; None (logged, counted) when it fails. Runs on the
        connection's thread. The TLS socket wraps a duplicate descriptor, so that the
        listener's shutdown of ``sock`` at close reaches it too."""
        assert self.tls is not None
        dup = sock.dup()
        try:
            dup.settimeout(self.hello_timeout)
            return self.tls.wrap_socket(dup, server_side=True)
        except OSError as exc:   # ssl.SSLError, a timeout, a reset
            dup.close()
            self.stats.add(errors=1, dropped=1)
            log.info("tcp %s: TLS handshake failed: %s", peer, exc)
            _linger(sock)
            return None

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, wait for their threads (seconds)."""
        if self._listener.closing:
            return
        self._listener.close(timeout)
        self.scratch.close()
        log.info("tcp data plane on port %d closed", self._port)

    def __enter__(self) -> TcpPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _linger(sock: socket.socket) -> None:
    """Stop sending, then read and discard what the peer still sends for up to
    :data:`GOODBYE_LINGER` seconds, so that the close is a FIN behind the TLS alert that
    refused the peer, not a reset that loses it (a TLS 1.3 client sends its first request
    before it learns that its certificate was refused)."""
    end = time.monotonic() + GOODBYE_LINGER
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass


def _refusal(err: SMBError) -> bytes:
    """The unsolicited answer (``req_id`` 0) a refused connection gets."""
    body = str(err).encode()
    return wire.pack_response(error_status(err), 0, len(body)) + body
