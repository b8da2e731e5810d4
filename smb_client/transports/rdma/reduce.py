"""A collective's ``REDUCE`` requests over RDMA: the rdma twin of
:class:`~smb_client.transports.stream.ReduceStream`, with the same surface, so the
exchanger (:mod:`smb_client.exchange`) sends through either.

One :class:`RdmaReduceStream` per memory server and client: a queue pair of its own
(the server may RDMA-WRITE into this side: sums), one sending caller and one polling
thread. Each chunk is RDMA-WRITTEN from the caller's buffer into the server's staging
area (memory the server registered for this party), and a small ``REDUCE`` message
SENT behind it names the staging range, the round and the registered buffers the sum
goes to (formats in :mod:`smb_protocol.rdma_wire`). The server answers ``PUSHED`` once
the push took effect (its staging range is free again), then, once every party pushed,
writes the sum straight into the caller's buffers and sends the final reply. No TCP
socket is in the round.

Caller buffers are registered once, zero-copy, and cached by their owner (a gradient
buffer, a torch storage): a collective registers its buffers on its first round,
never per round. Pieces that cannot be (no owner that lives across rounds, such as a
16-bit chunk narrowed for the wire, or more pieces than a message names) go through a
registered bounce ring of the stream: copied in before the push, out once the sum is
in.

Failures follow the tcp stream's rules: a queue pair that breaks fails every request
in flight with :class:`~smb_client.transports.errors.ConnectionBroken` (sent again on a
new queue pair with the same numbers: the server applies a push and counts a pull at
most once), or with :class:`~smb_protocol.errors.ServerUnavailable` when the server no
longer answers at all: while sums are owed and nothing arrives for :data:`PROBE_EVERY`
seconds, the stream RDMA-writes 8 bytes into the staging area's last bytes (kept out
of the pushes' ring); the server's kernel acknowledges that without its process, so a
probe unacknowledged for :data:`DEAD_PEER_SECONDS` (or failed: transport retries
exhausted) means the server or its host is gone (Soft-RoCE does not always report a
peer that vanished as a failed work request); the
server's notice before it drops the queue pair (NotPrimary during a move,
ExtentNotFound, TicketExpired) fails them with its typed error.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from smb_protocol import rdma_wire
from smb_protocol.errors import InvalidArgument, ProtocolError, ServerUnavailable, SMBError, status_error
from smb_protocol.rdma import verbs
from smb_protocol.rdma_wire import FINAL, PUSHED, ReduceMessage

from ..errors import ConnectionBroken
from ..stream import RECEIVER_JOIN, Reduction
from .chunk_buffers import ChunkBuffers, InFlight, Ring
from .connection import RECV_WR_BASE, SQ_DEPTH, RdmaConnection
from .peer import Broken
from .registration import RegistrationCache

log = logging.getLogger(__name__)

IN_FLIGHT = 8               # REDUCE messages sent and not yet answered PUSHED (the server has 16 receive slots)
RECV_DEPTH = 2 * IN_FLIGHT + 4   # reply slots: a PUSHED and a final reply per request, and a notice
PROBE_EVERY = 1.0           # seconds without a completion, sums owed, before probing the server
DEAD_PEER_SECONDS = 10.0    # seconds a probe may stay unacknowledged before the server counts as gone
PROBE_BYTES = 64            # bytes at the end of the staging area kept for probes
BYE_GRACE = 1.0             # seconds an abandoned queue pair waits for its BYE to go out
POLL_BATCH = 32
SPIN_POLLS = 64             # empty polls before napping
NAP_FIRST = 20e-6           # seconds
NAP_MAX = 1e-3              # seconds, while sums are owed
IDLE_WAIT = 0.05            # seconds the polling thread sleeps with nothing in flight
PROBE_WR_ID = 1 << 50       # wr_id of a liveness probe (an 8-byte RDMA WRITE into the staging area)


class _Link:
    """One queue pair of a stream and what is in flight on it (request id -> reduction)."""

    def __init__(self, conn: RdmaConnection) -> None:
        self.conn = conn
        self.pending: dict[int, InFlight] = {}
        self.staging: Ring | None = None
        self.failed: SMBError | None = None
        self.last_seen = time.monotonic()
        self.probing = 0.0          # monotonic time the outstanding probe went out (0: none)
        self.closing = 0.0          # abandoned: monotonic deadline for its BYE to go out (0: none)
        self.bye_seq = 0            # the BYE's work request number


class RdmaReduceStream:
    """The rdma ``REDUCE`` queue pair to one memory server. ``connect()`` makes an
    unconnected :class:`RdmaConnection` (remote-writable, :data:`RECV_DEPTH` reply
    slots); ``cache``: registrations the server may write into (shared by the process).
    Owns its queue pair and bounce ring."""

    def __init__(self, connect: Callable[[], RdmaConnection], cache: RegistrationCache, where: str) -> None:
        self._connect = connect
        self.cache = cache
        self.where = where
        self._sending = threading.Lock()      # one sender at a time
        self._cond = threading.Condition()    # the link, what is in flight, the rings
        self._link: _Link | None = None
        self.buffers = ChunkBuffers(cache, self._cond, self._broken)
        self._closed = False
        self._pollers: list[threading.Thread] = []   # polling threads not yet seen to end

    # -- sending --------------------------------------------------------------------------
    def send(self, ticket: str, r: Reduction) -> None:
        """Send ``r`` (presenting ``ticket`` first if this queue pair has not); its
        outcome comes through its callbacks, a failure to send included. Waits while
        :data:`IN_FLIGHT` requests are unanswered or the staging area is full."""
        with self._sending:
            link: _Link | None = None
            try:
                link = self._link_for(ticket)
                sent = InFlight(r)
                prepared = self._prepare(link, sent)
            except Broken as exc:
                err = ConnectionBroken(str(exc.error)) if exc.reconnect else exc.error
                if link is not None:
                    self._fail(link, err)
                r.done(err)
                return
            except SMBError as exc:
                r.done(exc)
                return
            if prepared is None:
                return
            pack, writes = prepared
            conn = link.conn
            with self._cond:
                while link.failed is None and conn.seq + len(writes) + 1 - conn.done > SQ_DEPTH:
                    self._cond.wait(IDLE_WAIT)
                failed = link.failed
                if failed is None:
                    req_id = conn.post_message(pack, writes)   # its id is known before a reply can come
                    link.pending[req_id] = sent
            if failed is not None:
                self._release(sent, link)
                r.done(failed)

    def _link_for(self, ticket: str) -> _Link:
        with self._cond:
            if self._closed:
                raise ServerUnavailable(f"{self.where}: the stream is closed")
            link = self._link
        if link is None:
            link = _Link(self._connect())
            try:
                link.conn.keys(ticket)      # connects the queue pair
            except BaseException:
                link.conn.broken = True
                link.conn.close()
                raise
            staging = link.conn.staging
            if not staging[2]:
                link.conn.close()
                raise InvalidArgument(f"{self.where}: a collective needs a writing ticket (no staging area)")
            link.staging = Ring(staging[2] - PROBE_BYTES)
            poller = threading.Thread(target=self._poll_loop, args=(link,), name=f"smb-rdma-reduce {self.where}",
                                      daemon=True)
            with self._cond:
                closed = self._closed   # asked again here: a close may have come meanwhile
                if not closed:
                    self._link = link
                    self._pollers = [t for t in self._pollers if t.is_alive()] + [poller]
                    poller.start()   # under the lock: a close never sees a thread it cannot join
            if closed:
                link.conn.close()   # says BYE and waits for it: not under the lock
                raise ServerUnavailable(f"{self.where}: the stream is closed")
        else:
            link.conn.keys(ticket)
        return link

    def _prepare(self, link: _Link, sent: InFlight) -> tuple[Callable[[memoryview, int], int],
                                                           list[tuple[int, int, int, int, int]]] | None:
        """Room for ``sent`` (staging range, bounce range, registrations) and the posts
        that send it; None when the link failed meanwhile (``sent`` was failed)."""
        r = sent.r
        conn = link.conn
        assert link.staging is not None
        if r.nbytes > link.staging.size:
            raise InvalidArgument(f"a chunk of {r.nbytes} bytes exceeds the server's staging area "
                                  f"of {link.staging.size} bytes")
        failed: SMBError | None = None
        with self._cond:
            while True:
                if link.failed is not None:
                    failed = link.failed
                    break
                unanswered = sum(1 for s in link.pending.values() if not s.pushed)
                got = link.staging.take(r.nbytes) if unanswered < IN_FLIGHT else None
                if got is not None:
                    sent.staging, at = got
                    break
                self._cond.wait(IDLE_WAIT)
        if failed is not None:
            r.done(failed)
            return None
        try:
            sources = self.buffers.local(sent, r.parts)
            dests = self.buffers.remote(sent, r.into)
        except BaseException:
            self._release(sent, link)
            raise
        s_addr, s_rkey, _ = conn.staging
        writes, pos = [], 0
        for laddr, lkey, n in sources:
            writes.append((laddr, lkey, n, s_addr + at + pos, s_rkey))
            pos += n
        req = r.request(conn.peer.client_id)
        arg0, arg1, timeout = req.args()

        def pack(buf: memoryview, req_id: int) -> int:
            return ReduceMessage(req.dtype, req_id, req.extent_id, req.offset, req.length, at, req.client,
                                 req.seq, arg0, arg1, timeout, dests).pack(buf)
        return pack, writes

    def _release(self, sent: InFlight, link: _Link | None = None) -> None:
        with self._cond:
            if link is not None and link.staging is not None and sent.staging:
                link.staging.free(sent.staging)
            sent.staging = 0
            self.buffers.release(sent)
            self._cond.notify_all()
        self.buffers.unhold(sent)

    # -- the polling thread ---------------------------------------------------------------
    def _poll_loop(self, link: _Link) -> None:
        import pyverbs.enums as e
        conn = link.conn
        idle = 0
        nap = NAP_FIRST
        try:
            while link.failed is None or (link.closing and conn.done < link.bye_seq
                                          and time.monotonic() < link.closing):
                wcs = conn.ep.poll(POLL_BATCH)
                if not wcs:
                    idle += 1
                    if not link.pending:
                        with self._cond:
                            if link.failed is None and not link.pending and not link.closing:
                                self._cond.wait(IDLE_WAIT)
                        link.last_seen = time.monotonic()
                        idle, nap = 0, NAP_FIRST
                    elif idle > SPIN_POLLS:
                        time.sleep(nap)
                        nap = min(NAP_MAX, nap * 2)
                        self._probe(link)
                    continue
                idle, nap = 0, NAP_FIRST
                link.last_seen = time.monotonic()
                for wc in wcs:
                    if wc.status != e.IBV_WC_SUCCESS:
                        raise self._failure(wc)
                    if wc.wr_id == PROBE_WR_ID:
                        link.probing = 0.0
                    elif wc.wr_id >= RECV_WR_BASE:
                        self._reply(link, wc.wr_id - RECV_WR_BASE)
                    elif wc.wr_id > conn.done:
                        conn.done = wc.wr_id
        except SMBError as exc:
            self._fail(link, exc)
        except Exception as exc:   # nothing may leave requests waiting forever
            if link.failed is None:   # (else the queue pair was closed under the poll)
                log.exception("%s: the reduce stream's polling failed", self.where)
                self._fail(link, ConnectionBroken(f"{self.where}: {type(exc).__name__}: {exc}"))
        finally:
            if link.closing:   # abandoned: its BYE went out (or its time is up)
                with self._cond:
                    link.conn.close()

    def _failure(self, wc: Any) -> SMBError:
        """The error of a failed work request: the server gone (transport retries
        exhausted) or the queue pair broken (sent again on a new one)."""
        import pyverbs.enums as e
        name = verbs.wc_status_name(wc.status)
        if wc.status in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR):
            return ServerUnavailable(f"{self.where}: no answer from the server ({name}): it died, or "
                                     "its host or link is down")
        return ConnectionBroken(f"{self.where}: the queue pair failed ({name})")

    def _probe(self, link: _Link) -> None:
        """With sums owed and nothing heard for :data:`PROBE_EVERY` seconds, write 8 bytes
        of the staging area: a dead server fails the read (transport retries exhausted)."""
        now = time.monotonic()
        if link.probing:
            if now - link.probing > DEAD_PEER_SECONDS:
                raise ServerUnavailable(f"{self.where}: the server acknowledged nothing for "
                                        f"{DEAD_PEER_SECONDS:g} s (its process or host is gone)")
            return
        if now - link.last_seen < PROBE_EVERY:
            return
        conn = link.conn
        with self._cond:   # posts run under it
            if link.failed is not None:
                return
            import pyverbs.enums as e
            qp, sge = conn.ep.qp, conn.ep.sge
            s_addr, s_rkey, _ = conn.staging
            qp.wr_start()
            qp.wr_id = PROBE_WR_ID
            qp.wr_flags = e.IBV_SEND_SIGNALED
            qp.wr_rdma_write(s_rkey, s_addr + conn.staging[2] - PROBE_BYTES)
            sge.addr, sge.length, sge.lkey = conn.base + conn.bounce_off, 8, conn.lkey
            qp.wr_set_sge(sge)
            qp.wr_complete()
            link.probing = link.last_seen = time.monotonic()

    def _reply(self, link: _Link, slot: int) -> None:
        conn = link.conn
        if link.failed is not None:   # abandoned: what it owed was failed already
            return
        try:
            req_id, status, kind, message = rdma_wire.unpack_reply_kind(conn.ep.slot(slot))
        except ValueError as exc:
            raise ProtocolError(f"{self.where}: {exc}") from None
        if req_id == 0:   # the server's notice: it is dropping this queue pair
            raise status_error(status, f"{self.where}: {message}")
        conn.ep.repost(slot)
        with self._cond:
            sent = link.pending.get(req_id)
            if sent is not None and (kind == PUSHED or kind == FINAL):
                if kind == FINAL:
                    del link.pending[req_id]
                if not sent.pushed and link.staging is not None:
                    link.staging.free(sent.staging)
                    sent.staging = 0
                    sent.pushed = True
                self._cond.notify_all()
        if sent is None:
            raise ProtocolError(f"{self.where}: a reply to request {req_id}, which is not in flight")
        r = sent.r
        if kind == PUSHED:
            if status == 0:
                r.pushed()
            return
        err = None
        if status != 0:
            err = status_error(status, f"{self.where}: {message}")
        else:
            self.buffers.copy_out(sent)
            if r.received is not None:
                r.received()
        self._release(sent)
        r.done(err)

    def _fail(self, link: _Link, err: SMBError, bye: bool = False) -> None:
        """``link`` is done for: fail everything in flight on it and close its queue pair;
        with ``bye`` (the queue pair still works), first tell the server, whose threads
        then stop serving it at once (a server learns nothing of a queue pair destroyed
        without a word, and would hold its half-served chunks)."""
        conn = link.conn
        with self._cond:   # no post runs meanwhile (they run under it)
            if link.failed is not None:
                return
            link.failed = err
            if self._link is link:
                self._link = None
            pending, link.pending = list(link.pending.values()), {}
            self._cond.notify_all()
            if bye and not conn.closed and conn.remote is not None:
                conn.post_message(lambda buf, req_id: _pack_bye(buf, req_id))
                link.bye_seq, link.closing = conn.seq, time.monotonic() + BYE_GRACE
            conn.broken = True
            if not link.closing:
                conn.close()
        if pending:
            log.info("%s: %d requests in flight failed: %s", self.where, len(pending), err)
        for sent in pending:
            self._release(sent)
            sent.r.done(err)

    # -- the exchanger's view -------------------------------------------------------------
    def in_flight(self) -> int:
        with self._cond:
            link = self._link
            return 0 if link is None else len(link.pending)

    def abandon(self) -> None:
        """Close the queue pair now, failing what is in flight."""
        with self._cond:
            link = self._link
        if link is not None:
            self._fail(link, ConnectionBroken(f"{self.where}: abandoned"), bye=True)

    def close(self) -> None:
        """Fail what is in flight, close the queue pair, wait for the polling threads (why: ReduceStream.close)."""
        with self._cond:
            self._closed = True
            pollers, self._pollers = self._pollers, []
        self.abandon()
        for poller in pollers:
            if poller is not threading.current_thread():
                poller.join(RECEIVER_JOIN)
        self.buffers.close()

    def _broken(self) -> bool:
        """Whether the queue pair broke (a wait for bounce room gives up; ``_cond`` held)."""
        return self._link is None or self._link.failed is not None


def _pack_bye(buf: memoryview, req_id: int) -> int:
    rdma_wire.pack_request(buf, rdma_wire.MsgOp.BYE, req_id)
    return rdma_wire.REQUEST.size
