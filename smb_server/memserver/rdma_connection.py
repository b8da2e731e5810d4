"""One client queue pair on a memory server: its endpoint, the tickets presented on it,
its staging area, and the two-sided requests it hands to the node's request engine
(:mod:`.engine`; see :mod:`.rdma_plane`). A request's operand is read straight from
the staging area, where the client's RDMA WRITE put it. A collective's ``REDUCE``
requests are parsed here and served by the queue pair's :mod:`.rdma_reduce` threads;
every post on the queue pair takes one lock (those threads post too)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from smb_protocol import rdma_wire, requests
from smb_protocol.errors import (
    InvalidArgument,
    OutOfRange,
    ReadOnly,
    ServerUnavailable,
    SMBError,
    Status,
    error_status,
)
from smb_protocol.rdma import verbs
from smb_protocol.rdma.endpoint import RcEndpoint, RegisteredBuffer
from smb_protocol.rdma_wire import MSG_BYTES, MsgOp
from smb_protocol.tickets import Ticket

from .access import TicketBook
from .engine import Engine
from .node import Node
from .peer import Repeat, Whole
from .rdma_reduce import ReduceService
from .stats import PlaneStats

log = logging.getLogger(__name__)

RECV_DEPTH = 16           # request slots (posted receives) per connection
REDUCE_SLOTS = 2 * RECV_DEPTH   # message slots of REDUCE replies (each freed by its SEND's completion)
SEND_DEPTH = 8 * RECV_DEPTH     # replies, REDUCE replies and the RDMA WRITEs of sums
CQ_DEPTH = SEND_DEPTH + 2 * RECV_DEPTH
POLL_BATCH = 16           # completions taken per poll
NOTICE_GRACE = 0.2        # seconds a doomed connection waits for its notice to go out
NOTICE_SLOT = 2 * RECV_DEPTH  # message slot of the server's unsolicited notice
RECV_WR_BASE = 0          # wr_id of receive slot i: i
SEND_WR_BASE = 1 << 20    # wr_id of reply slot i: SEND_WR_BASE + i
REDUCE_SLOT_BASE = NOTICE_SLOT + 1   # message slot of REDUCE reply i: REDUCE_SLOT_BASE + i
WRITE_WR_ID = 1 << 30     # wr_id of the (unsignaled) RDMA WRITEs of sums
DEDUP_WAIT = 1.0          # seconds a repeat waits for its first attempt (another plane's) to end
DELIVERY_TIMEOUT = 10.0   # seconds a sum's final reply may stay unacknowledged before the client counts as gone


def _op_name(op: int) -> str:
    """The metrics label of a two-sided request (``accumulate``, ``axpy``, ``scale``)."""
    try:
        return MsgOp(op).name.lower()
    except ValueError:
        return "unknown"


class ServerConnection:
    """One client queue pair: message slots, (once a writing ticket is presented) a
    staging area, and the tickets presented on it.

    The queue pair grants the peer REMOTE_READ | REMOTE_WRITE | REMOTE_ATOMIC; what the
    peer may reach is decided by the rkeys it was given (a read-only ticket gets the
    read-only registrations). Two-sided requests are checked against the ticket
    presented for their extent (:class:`~.access.TicketBook`). Owns its endpoint and
    staging area; only the plane's progress thread (or the plane's close) closes it.
    """

    #: the engine's view of this connection (.peer.Peer): a repeat waits at most this
    #: long for its first attempt (another plane's), since this thread serves every queue pair
    dedup_wait = DEDUP_WAIT
    takes_replicated = False   # mutations of replicated extents go to the primary's tcp plane

    def __init__(self, node: Node, engine: Engine, device: verbs.Device, stats: PlaneStats,
                 staging_bytes: int, staging_access: int, peer: verbs.QPInfo, peer_name: str,
                 local_key: Callable[[int, int, int], int | None] = lambda *_: None) -> None:
        import pyverbs.enums as e
        self.node = node
        self.engine = engine
        self.device = device
        self.stats = stats
        self.staging_bytes = staging_bytes
        self.staging_access = staging_access
        self.peer = self.name = peer_name
        self.peer_key = (bytes(peer.gid), peer.qpn, peer.psn)
        self.tickets = TicketBook()
        self._presented: tuple[Ticket, ...] = ()    # in the order presented (copy on write)
        self._staging_at = 0                        # staging offset of the request being served
        self.extent_ids: frozenset[int] = frozenset()
        self.staging: RegisteredBuffer | None = None
        self.doomed = ""
        self.notice: tuple[int, str] | None = None   # (status, message) to tell the client
        self.notice_deadline = 0.0                   # monotonic seconds; 0: not sent yet
        self.notice_done = False
        self.local_key = local_key
        self.reduce: ReduceService | None = None     # made on the first REDUCE
        self._posting = threading.Condition()        # every post; REDUCE reply slots
        self._free_slots = list(range(REDUCE_SLOTS))
        self._awaited: set[int] = set()              # REDUCE reply slots whose completion a thread waits for
        self._sent: set[int] = set()                 # ... and whose SEND completed
        dev = device
        self.ep = RcEndpoint(dev, (REDUCE_SLOT_BASE + REDUCE_SLOTS) * MSG_BYTES, sq_depth=SEND_DEPTH,
                             recv_slots=RECV_DEPTH, slot_bytes=MSG_BYTES, recv_wr_base=RECV_WR_BASE,
                             cq_depth=CQ_DEPTH)
        try:
            self.mtu = verbs.negotiate_mtu(peer.mtu, dev.info.active_mtu)
            remote = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
            self.ep.connect(peer, self.mtu, remote, dev.rd_atomic())
        except BaseException:
            self.ep.close()
            raise
        self.psn = self.ep.psn
        self.info = self.ep.local_info()

    # -- tickets --------------------------------------------------------------------------
    def ensure_staging(self) -> RegisteredBuffer:
        """The staging area for arithmetic operands (made when first needed)."""
        if self.staging is None:
            self.staging = RegisteredBuffer(self.device, self.staging_bytes, self.staging_access)
        return self.staging

    def add_ticket(self, ticket: Ticket, extent_ids: frozenset[int]) -> None:
        """Present ``ticket`` on this connection (the plane's lock held): its extents
        here are ``extent_ids``."""
        self.tickets.add(ticket)
        tickets = self._presented + (ticket,)
        in_force = set(self._current(tickets).values())
        self._presented = tuple(t for t in tickets if t in in_force)   # superseded ones go
        self.extent_ids = self.extent_ids | extent_ids

    def _current(self, tickets: tuple[Ticket, ...] | None = None) -> dict[int, Ticket]:
        """The ticket in force for each extent (the last one presented naming it)."""
        out: dict[int, Ticket] = {}
        for t in self._presented if tickets is None else tickets:
            for extent_id in t.extent_ids:
                out[extent_id] = t
        return out

    def expired(self, now: float) -> bool:
        """True when the ticket in force for some extent expired (a renewed ticket,
        presented in time, supersedes the old one)."""
        return any(t.expires_at < now for t in set(self._current().values()))

    # -- messages -----------------------------------------------------------------------
    def _reply(self, slot: int, req_id: int, status: int, message: str = "", notice: bool = False) -> None:
        index = NOTICE_SLOT if notice else RECV_DEPTH + slot
        with self._posting:
            if self.ep.closed:
                return
            n = rdma_wire.pack_reply(self.ep.slot(index), req_id, status, message)
            self.ep.post(SEND_WR_BASE + (NOTICE_SLOT if notice else slot), True, "send",
                         self.ep.base + index * MSG_BYTES, n)

    # -- REDUCE replies (the reduce service's threads) -------------------------------------
    def _reduce_slot(self) -> int:
        """A free REDUCE reply slot (``_posting`` held); waits while every one is in flight."""
        while not self._free_slots:
            if self.doomed or self.ep.closed:
                raise ServerUnavailable(f"rdma {self.name}: the queue pair is closing ({self.doomed})")
            self._posting.wait(0.05)
        return self._free_slots.pop()

    def _post_reply(self, req_id: int, status: int, message: str, kind: int,
                    writes: list[tuple[int, int, int, int, int]], awaited: bool = False) -> int:
        """Post ``writes`` (local address, lkey, bytes, remote address, rkey) and a reply,
        under the post lock; returns the reply's slot (``awaited``: the caller waits for
        its completion and frees it)."""
        with self._posting:
            if self.doomed or self.ep.closed:
                raise ServerUnavailable(f"rdma {self.name}: the queue pair is closing ({self.doomed})")
            i = self._reduce_slot()
            if awaited:
                self._awaited.add(i)
            index = REDUCE_SLOT_BASE + i
            for laddr, lkey, n, raddr, rkey in writes:
                self.ep.post(WRITE_WR_ID, False, "write", laddr, n, lkey=lkey, rkey=rkey, raddr=raddr)
            n = rdma_wire.pack_reply(self.ep.slot(index), req_id, status, message, kind)
            self.ep.post(SEND_WR_BASE + index, True, "send", self.ep.base + index * MSG_BYTES, n)
            return i

    def reply(self, req_id: int, status: int, message: str = "", kind: int = rdma_wire.FINAL) -> None:
        """SEND a REDUCE's reply (a PUSHED one, or an error) without waiting."""
        self._post_reply(req_id, status, message, kind, [])

    def write_and_reply(self, req_id: int, writes: list[tuple[int, int, int, int, int]]) -> None:
        """RDMA-WRITE a sum, SEND its final reply and wait until that SEND completed (the
        client has the sum) or the queue pair is gone; then the answer went out, as a tcp
        answer has once it is in the socket (a client that missed it sends the request
        again and is answered again). A queue pair that breaks first is waited for until
        it is destroyed, so that no WRITE still reads the slot once the pull is counted.
        After :data:`DELIVERY_TIMEOUT` the connection is doomed: the client's process or
        host is gone (a queue pair that vanished is not always reported as a failed work
        request, and its half-served chunks must not hold the slot's round)."""
        i = self._post_reply(req_id, Status.OK, "", rdma_wire.FINAL, writes, awaited=True)
        deadline = time.monotonic() + DELIVERY_TIMEOUT
        with self._posting:
            try:
                while i not in self._sent and not self.ep.closed:
                    if not self.doomed and time.monotonic() > deadline:
                        self.doom(f"a sum was not acknowledged within {DELIVERY_TIMEOUT:g} s")
                    self._posting.wait(0.05)
            finally:
                self._awaited.discard(i)
                self._sent.discard(i)
                self._free_slots.append(i)

    def _reduce_sent(self, i: int) -> None:
        """The SEND of REDUCE reply slot ``i`` completed (the progress thread)."""
        with self._posting:
            if i in self._awaited:
                self._sent.add(i)
            else:
                self._free_slots.append(i)
            self._posting.notify_all()

    def staging_view(self, offset: int, length: int) -> memoryview:
        """``length`` bytes of the staging area at ``offset`` (a REDUCE's push)."""
        area = self.staging
        if area is None:
            raise ReadOnly("no writing ticket was presented on this queue pair (no staging area)")
        if offset < 0 or offset + length > area.length:
            raise OutOfRange(f"staging range [{offset}, {offset + length}) outside the "
                             f"{area.length}-byte staging area")
        return area.view[offset:offset + length]

    def new_buffer(self, length: int) -> RegisteredBuffer:
        """A registered buffer the queue pair may send from (owned by the caller)."""
        import pyverbs.enums as e
        return RegisteredBuffer(self.device, length, e.IBV_ACCESS_LOCAL_WRITE)

    def progress(self) -> int:
        """Poll once and serve what arrived; returns the number of completions."""
        import pyverbs.enums as e
        wcs = self.ep.poll(POLL_BATCH)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                if not self.doomed:
                    self.doomed = f"completion error {verbs.wc_status_name(wc.status)}"
                self.notice_done = True
                continue
            if wc.wr_id == SEND_WR_BASE + NOTICE_SLOT:
                self.notice_done = True
            elif 0 <= wc.wr_id - SEND_WR_BASE - REDUCE_SLOT_BASE < REDUCE_SLOTS:
                self._reduce_sent(wc.wr_id - SEND_WR_BASE - REDUCE_SLOT_BASE)
            if wc.wr_id >= SEND_WR_BASE or self.doomed:
                continue
            self._serve(wc.wr_id - RECV_WR_BASE, wc.byte_len)
        return len(wcs)

    def _serve(self, slot: int, nbytes: int) -> None:
        try:
            if rdma_wire.request_op(self.ep.slot(slot)) == MsgOp.REDUCE:
                msg = rdma_wire.ReduceMessage.unpack(self.ep.slot(slot))
                self.ep.repost(slot)
                if self.reduce is None:
                    self.reduce = ReduceService(self, self.engine, self.local_key)
                self.reduce.submit(msg)
                return
            (op, dtype, req_id, extent_id, offset, length, staging, alpha, client,
             seq) = rdma_wire.unpack_request(self.ep.slot(slot))
        except Exception as exc:
            self.doomed = f"malformed message ({nbytes} bytes): {exc}"
            return
        if op == MsgOp.BYE:
            self.doomed = "closed by the client"
            return
        self.ep.repost(slot)   # the slot's content is parsed: reuse it
        stats = self.stats
        status: int = Status.OK
        message = ""
        start = time.perf_counter()
        req = requests.from_message(op, dtype, req_id, extent_id, offset, length, alpha, client, seq)
        try:
            if req is None:
                raise InvalidArgument(f"unknown rdma request {op}")
            self._staging_at = staging
            self.engine.handle(self, req)
            stats.add(operations=1)
        except Repeat as rep:
            status, message = rep.status, rep.body.decode(errors="replace")
            stats.add(operations=1, errors=1)
        except SMBError as exc:
            status, message = error_status(exc), str(exc)
            stats.add(operations=1, errors=1)
            log.debug("rdma %s: %s on extent %d failed: %s", self.peer, op, extent_id, exc)
        except Exception as exc:
            status, message = Status.INTERNAL, f"{type(exc).__name__}: {exc}"
            stats.add(operations=1, errors=1)
            log.exception("rdma %s: %s on extent %d failed", self.peer, op, extent_id)
        self._reply(slot, req_id, status, message)
        stats.observe(_op_name(op), time.perf_counter() - start)

    # -- the engine's view of this connection (.peer.Peer) ---------------------------------
    @contextmanager
    def payload(self, length: int) -> Iterator[Whole]:
        """The request's operand: ``length`` bytes of the staging area, where the
        client wrote them (no copy)."""
        if length == 0:   # SCALE: no operand
            yield Whole(memoryview(b""))
            return
        area = self.staging
        if area is None:
            raise ReadOnly("no writing ticket was presented on this queue pair (no staging area)")
        at = self._staging_at
        if at < 0 or at + length > area.length:
            raise OutOfRange(f"staging range [{at}, {at + length}) outside the "
                             f"{area.length}-byte staging area")
        yield Whole(area.view[at:at + length])

    def send(self, req_id: int, view: memoryview) -> None:
        raise InvalidArgument("reads are one-sided on the rdma data plane")

    def cancelled(self) -> bool:
        return bool(self.doomed)

    # -- ending ---------------------------------------------------------------------------
    def doom(self, reason: str, notice: SMBError | None = None) -> None:
        """Stop serving (any thread); the progress thread tells the client ``notice``
        (when given, and the QP still works) and closes the connection."""
        if notice is not None and self.notice is None:
            self.notice = (int(error_status(notice)), str(notice))
        if not self.doomed:
            self.doomed = reason

    def finish(self) -> bool:
        """Progress-thread side of :meth:`doom`: send the notice and wait for it (at most
        :data:`NOTICE_GRACE`); True once the connection may be closed."""
        if self.notice is None or self.ep.closed:
            return True
        if not self.notice_deadline:
            self.notice_deadline = time.monotonic() + NOTICE_GRACE
            try:
                self._reply(0, 0, *self.notice, notice=True)
            except Exception as exc:
                log.debug("rdma %s: notice not sent: %s", self.peer, exc)
                return True
        if not self.notice_done:
            try:
                self.progress()      # doomed: requests are ignored, the notice's completion counts
            except Exception:
                return True
        return self.notice_done or time.monotonic() > self.notice_deadline

    def close(self) -> None:
        """Stop the reduce service, destroy the endpoint (QP first), then the staging
        area (progress thread or the plane's close)."""
        if not self.doomed:
            self.doomed = "closed"
        if self.reduce is not None:
            self.reduce.stop()
        with self._posting:
            self.ep.close()
            self._posting.notify_all()
        if self.reduce is not None:
            self.reduce.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
