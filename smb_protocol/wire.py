"""The TCP data-plane protocol: framing shared by client and memory server.

A connection presents tickets with ``HELLO`` frames, one per region, before the first
request that needs each (and again with a renewed ticket); the server verifies each and
records it by the extent ids it names, a later ticket for an extent replacing the
earlier one. Every request is checked against the ticket naming its extent. A request
is a fixed 72-byte header and, for ``WRITE``/``ACCUMULATE``/``AXPY``, ``length``
payload bytes. The server answers every request with a 16-byte header (in order, but
for ``REDUCE``: see below) and, for ``READ`` and the atomics, a payload; an error
answer carries a UTF-8 message as payload. All integers are little-endian. A header
with a wrong magic, an unknown opcode or an oversized length closes the connection.

A server refuses a connection it cannot take (full, too many from one peer address,
out of descriptors) with one unsolicited error answer, ``req_id`` 0 and status
``SERVER_BUSY``, whose message names the limit, and closes it. It also closes a
connection that sends no ``HELLO`` within its HELLO deadline, or whose frame (header
and payload) does not arrive whole within its frame deadline, after a parting answer
of the same form with status ``TIMEOUT``. Clients number requests from 1, so an
error answer with ``req_id`` 0 is always one of these.

Exactly once: every mutating request carries the sending client's random 64-bit id and
a sequence number (``seq``, 0 for "not tracked"); a retry of a request (after a lost
connection or a renewed ticket) reuses its number. The server applies a numbered request
at most once and answers a repeat with the first answer (see
``smb_server/memserver/dedup.py``).

Replicated extents (``smb_server/memserver/replication.py``): clients send every
mutation of a replicated region to its primary's tcp plane; a backup answers a client's
mutation with ``NOT_PRIMARY``. The primary applies a request in *pieces* of at most 4 MiB
under the extent's lock and forwards each piece, still under the lock, to every backup
on a connection that presented a ``replica`` ticket (signed by the primary with the
shared secret, naming the backup's extent, ``view`` = the replica set's version); it
waits for the backup's answer before the next mutation of that extent. A piece is an
ordinary request frame: the original ``op``, ``dtype``, ``alpha``, ``client`` and
``seq``, the backup's ``extent_id``, and

* ``WRITE``/``ACCUMULATE``/``AXPY``/``SCALE``: the piece's ``offset``/``length`` (and
  its payload), with the *whole request's* offset and length in ``arg0``/``arg1``;
* ``FETCH_ADD``/``COMPARE_SWAP``: the request itself (one word; the backup computes
  the same answer, its copy being identical);
* ``LOCK``/``UNLOCK``: the word's new value in ``arg0`` and the request's answer in
  ``arg1`` (the backup stores the word; leases stay on the primary).

The backup files a numbered piece under the original request's dedup entry (the same
``what`` as the client's request: op, extent, offset, length, dtype) and counts the
applied payload bytes, so a client that retries at the promoted backup gets "done" or
resumes after them. ``seq`` 0 pieces (an unnumbered request, and ``WRITE`` chunks of a
sync copy) are applied without bookkeeping. A piece whose ticket has an older view than
the backup's is refused with ``NOT_PRIMARY`` (a deposed primary); a newer view makes
the extent a backup of that view.

Over TLS (``tcp+tls://`` endpoints) the frames are the same inside the TLS stream;
:func:`sendmsg_all` and :func:`recv_into_all` hand TLS sockets to the loops of
:mod:`smb_protocol.tls` (no ``sendmsg``/``recvmsg_into`` there) and keep the plain path as
it is.

Traces (:mod:`smb_protocol.tracing`): a request sent inside a sampled trace has the
:data:`TRACED` bit set in its ``op`` byte, and its header is followed by the trace's W3C
``traceparent`` (:data:`TRACE_SIZE` ASCII bytes), then by its payload as usual; ``length``
counts the payload only. Other requests (every request while tracing is off) are
unchanged. A server that does not trace reads and drops the traceparent.

Request:  magic u16 | op u8 | dtype u8 | req_id u32 | extent_id u64 | offset u64 |
          length u64 | arg0 i64 | arg1 i64 | alpha f64 | client u64 | seq u64
Response: magic u16 | status u8 | kind u8 | req_id u32 | length u64
"""
from __future__ import annotations

import enum
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence

from smb_protocol import tls

from .errors import ProtocolError, ServerUnavailable
from .sockio import IOV_MAX, LOWAT_MAX, LOWAT_MIN, consume, recv_exact, recv_into_all, wait_ready

__all__ = ["IOV_MAX", "LOWAT_MAX", "LOWAT_MIN", "ServerUnavailable", "consume", "recv_exact", "recv_into_all",
           "wait_ready"]   # the socket loops (smb_protocol.sockio), where callers have always found them

MAGIC = 0x5342
REQUEST = struct.Struct("<HBBIQQQqqdQQ")
RESPONSE = struct.Struct("<HBBIQ")
MAX_PAYLOAD = 1 << 30       # bytes in one request
MAX_TICKET = 64 << 10       # bytes
TRACED = 0x80               # op byte flag: a traceparent follows the header
TRACE_SIZE = 55             # bytes of that traceparent (W3C version 00)
KEEPALIVE_IDLE = 1          # seconds a connection is idle before its first keepalive probe
KEEPALIVE_INTERVAL = 1      # seconds between keepalive probes


class Op(enum.IntEnum):
    HELLO = 1
    READ = 2
    WRITE = 3
    ACCUMULATE = 4
    SCALE = 5
    AXPY = 6
    FETCH_ADD = 7
    COMPARE_SWAP = 8
    PING = 9
    WAIT = 10          # until a word meets a condition (see WaitCond); blocks its connection
    LOCK = 11          # take or renew a leased lock word
    UNLOCK = 12        # free a lock word this holder holds
    PUSH = 13          # a collective's push: store or add a chunk, count the arrival
    PULL = 14          # a collective's pull: wait for the count, read the chunk, count the read
    SEED = 15          # memory servers only: a primary's exactly-once entries for a copy it filled
    REDUCE = 16        # a collective's push whose sum the server streams back (see REDUCE below)


class WaitCond(enum.IntEnum):
    """The condition a ``WAIT`` request waits for (its ``dtype`` byte) against ``arg0``."""

    AT_LEAST = 1       # word >= value (a counter reached value)
    EQUAL = 2          # word == value
    CHANGED = 3        # word != value

    def describe(self, value: int) -> str:
        return {WaitCond.AT_LEAST: f">= {value}", WaitCond.EQUAL: f"== {value}",
                WaitCond.CHANGED: f"changed from {value}"}[self]


#: operations whose request carries ``length`` payload bytes
PAYLOAD_OPS = frozenset({Op.HELLO, Op.WRITE, Op.ACCUMULATE, Op.AXPY, Op.PUSH, Op.SEED, Op.REDUCE})
#: operations that change extent memory (refused on read-only tickets)
WRITE_OPS = frozenset({Op.WRITE, Op.ACCUMULATE, Op.SCALE, Op.AXPY, Op.FETCH_ADD, Op.COMPARE_SWAP,
                       Op.LOCK, Op.UNLOCK, Op.PUSH, Op.PULL, Op.REDUCE})
#: coordination requests (one int64 word; served by ``smb_server/memserver/coord_ops.py``):
#: WAIT: dtype = WaitCond, arg0 = value, alpha = timeout (s); LOCK: arg0 = holder id,
#: arg1 = lease (ms), alpha = timeout (s); UNLOCK: arg0 = holder id. Each answers the
#: word's value (8 bytes) or an error (TIMEOUT, LOCK_NOT_HELD).
COORD_OPS = frozenset({Op.WAIT, Op.LOCK, Op.UNLOCK})
#: a collective's chunk requests (``smb_client/collective.py``), each on a chunk of at most
#: :data:`MAX_CHUNK` bytes with its int64 count word in the same extent. Each names the
#: round it belongs to (:class:`smb_protocol.rounds.ChunkRound`): ``arg0`` packs the count
#: word's offset (low 48 bits) and the number of parties (above), ``arg1`` is the round
#: (from 0; bit 62 marks a broadcast root's push); ``alpha`` is the wait's timeout (s).
#: The count word names the round its slot holds and its arrivals, and the server refuses
#: a push or pull that does not fit it with ``ROUND_MISMATCH`` (see :mod:`smb_protocol.rounds`).
#: PUSH (payload, ``dtype``): waits until the slot's previous round ended, stores the
#: payload as the round's first arrival or adds it, and counts the arrival; answers the
#: count word before. PULL: waits until every party's push is in, answers the chunk's
#: bytes, then counts the pull (the chunk may be overwritten once every party pulled it).
#: Both are numbered (exactly once; a repeated PULL sends the bytes again and counts
#: nothing, or is refused once a later round overwrote them).
#:
#: REDUCE is a PUSH and its PULL in one request, for connections that pipeline
#: (``smb_client/transports/stream.py``), with the fields of a PUSH. The server answers
#: twice, under the request's ``req_id``: once the push is applied, an answer of kind
#: :data:`PUSHED` (8 bytes: the count word before); then, as soon as every party's push
#: landed, the chunk's sum (kind :data:`FINAL`), and counts the pull. The pull is
#: numbered ``seq + 1`` (a client spaces its numbers). Answers of different requests on
#: one connection may interleave at frame boundaries; an error is always a final answer,
#: and no request gets an answer after its final one.
COLLECTIVE_OPS = frozenset({Op.PUSH, Op.PULL, Op.REDUCE})
MAX_CHUNK = 4 << 20         # bytes of one PUSH, PULL or REDUCE
FINAL = 0                   # answer kind (the response's fourth byte): the request's last answer
PUSHED = 1                  # answer kind: a REDUCE's push took effect; its sum follows


def pack_request(op: int, req_id: int = 0, extent_id: int = 0, offset: int = 0, length: int = 0,
                 dtype: int = 0, arg0: int = 0, arg1: int = 0, alpha: float = 0.0, *,
                 client: int = 0, seq: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, op, dtype, req_id & 0xFFFFFFFF, extent_id, offset, length,
                        arg0, arg1, alpha, client, seq)


def pack_response(status: int, req_id: int, length: int, kind: int = FINAL) -> bytes:
    return RESPONSE.pack(MAGIC, status, kind, req_id & 0xFFFFFFFF, length)


def sendmsg_all(sock: socket.socket, buffers: Sequence[memoryview | bytes], flags: int = 0,
                stall: float | None = None, on_stall: Callable[[float], None] | None = None) -> None:
    """Send every buffer, in order, with as few syscalls as the kernel allows (no copies).
    ``flags``: for ``sendmsg`` (``socket.MSG_MORE``: more follows at once, so the kernel
    holds these bytes for the next send's segment; not on TLS sockets). On a
    non-blocking socket (timeout 0: one syscall a send, no poll before it) a full send
    buffer is waited for, at most ``stall`` seconds at a time (None: no limit), then
    TimeoutError; other sockets wait as their own timeout says, and then, with
    ``on_stall``, it is called with the seconds since the last progress (it may raise)
    and the send goes on."""
    if isinstance(sock, ssl.SSLSocket):   # no sendmsg on TLS sockets
        tls.send_all(sock, buffers, on_stall)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    since = time.monotonic()
    while views:
        try:
            sent = sock.sendmsg(views[:IOV_MAX], (), flags)
        except BlockingIOError:
            if sock.gettimeout() != 0.0:
                raise
            wait_ready(sock, True, stall)
            continue
        except TimeoutError as exc:
            if on_stall is None or exc.errno is not None:   # errno: the kernel ended the connection
                raise
            on_stall(time.monotonic() - since)
            continue
        consume(views, sent)
        since = time.monotonic()


class PatientSender:
    """Sends on a blocking socket that has a dead-peer time (:func:`set_dead_peer_timeout`),
    without letting Linux end the connection while the peer is there but reads nothing.

    Linux counts a receive window the peer keeps shut for ``TCP_USER_TIMEOUT`` as a dead
    peer, although the peer's kernel answers every probe: a live memory server that does
    not read a connection for a few seconds (its request waits for a scratch buffer, an
    extent's lock, a backup, or an earlier attempt of the same request) would be taken
    for a dead one. :meth:`send` waits in slices of a quarter of the dead-peer time; a
    slice without progress while the peer advertises a shut window lifts the user
    timeout (the peer is waited for up to ``io_timeout`` seconds without progress, then
    TimeoutError), and it is set again once the window is seen open (:meth:`settled`,
    called once the answer came, or a later slice)."""

    __slots__ = ("sock", "dead_peer", "io_timeout", "lifted")

    def __init__(self, sock: socket.socket, dead_peer: float, io_timeout: float) -> None:
        self.sock = sock
        self.dead_peer = dead_peer
        self.io_timeout = io_timeout
        self.lifted = False

    def send(self, buffers: Sequence[memoryview | bytes]) -> None:
        self.sock.settimeout(min(self.io_timeout, self.dead_peer / 4))
        try:
            sendmsg_all(self.sock, buffers, on_stall=self._stalled)
        finally:
            self.sock.settimeout(self.io_timeout)

    def _stalled(self, seconds: float) -> None:
        if seconds >= self.io_timeout:
            raise TimeoutError(f"the peer took no data for {self.io_timeout:g} s")
        shut = window_shut(self.sock)
        if shut and not self.lifted:
            self._user_timeout(0)
        elif shut is False and self.lifted:
            self._user_timeout(self.dead_peer)

    def settled(self) -> None:
        """The answer is in (the peer read everything): the user timeout back, if lifted."""
        if self.lifted:
            self._user_timeout(self.dead_peer)

    def _user_timeout(self, seconds: float) -> None:
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
        self.lifted = seconds == 0


_TCP_INFO = 232          # bytes of Linux's struct tcp_info up to tcpi_snd_wnd (5.4 and later)
_SND_MSS, _SND_WND = 16, 228   # offsets of tcpi_snd_mss and tcpi_snd_wnd in it


def window_shut(sock: socket.socket) -> bool | None:
    """Whether ``sock``'s peer advertises a receive window smaller than a segment (it is
    there, but reads nothing); None where the kernel does not say."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO)
    except OSError:
        return None
    if len(info) < _TCP_INFO:
        return None
    (mss,) = struct.unpack_from("<I", info, _SND_MSS)
    (wnd,) = struct.unpack_from("<I", info, _SND_WND)
    return bool(wnd < max(1, mss))


def set_keepalive(sock: socket.socket, seconds: float) -> None:
    """Have the kernel probe ``sock``'s peer after a second without traffic and end the
    connection (``ETIMEDOUT``, or the reset the peer's kernel answers for a socket it no
    longer has) once about ``seconds`` of probes went unanswered. Only while nothing
    waits to be sent: a peer that stops reading is not ended by this."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive defaults
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(seconds / KEEPALIVE_INTERVAL)))


def set_dead_peer_timeout(sock: socket.socket, seconds: float) -> None:
    """:func:`set_keepalive`, and ``TCP_USER_TIMEOUT``: the connection also ends once data
    sent stays unacknowledged for ``seconds``. (Linux counts a receive window the peer
    keeps shut for that long the same way, even while it answers the probes.)"""
    set_keepalive(sock, seconds)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000)))


def unpack_response(data: bytes | bytearray) -> tuple[int, int, int]:
    """(status, req_id, length) of a response header."""
    status, _kind, req_id, length = unpack_answer(data)
    return status, req_id, length


def unpack_answer(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """(status, kind, req_id, length) of a response header (kind: :data:`FINAL` or
    :data:`PUSHED`)."""
    magic, status, kind, req_id, length = RESPONSE.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad response magic {magic:#x}")
    return status, kind, req_id, length
