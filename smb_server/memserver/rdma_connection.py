"""One client queue pair on a memory server: its endpoint, the tickets presented on it,
its staging area, and the two-sided requests it hands to the node's request engine
(:mod:`.engine`; see :mod:`.rdma_plane`). A request's operand is read straight from
the staging area, where the client's RDMA WRITE put it."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from smb_protocol import rdma_wire, requests
from smb_protocol.errors import InvalidArgument, OutOfRange, ReadOnly, SMBError, Status, error_status
from smb_protocol.rdma import verbs
from smb_protocol.rdma.endpoint import RcEndpoint, RegisteredBuffer
from smb_protocol.rdma_wire import MSG_BYTES, MsgOp
from smb_protocol.tickets import Ticket

from .access import TicketBook
from .engine import Engine
from .node import Node
from .peer import Repeat
from .stats import PlaneStats

log = logging.getLogger(__name__)

RECV_DEPTH = 16           # request slots (posted receives) per connection
SEND_DEPTH = 2 * RECV_DEPTH
CQ_DEPTH = 4 * RECV_DEPTH
POLL_BATCH = 16           # completions taken per poll
NOTICE_GRACE = 0.2        # seconds a doomed connection waits for its notice to go out
NOTICE_SLOT = 2 * RECV_DEPTH  # message slot of the server's unsolicited notice
RECV_WR_BASE = 0          # wr_id of receive slot i: i
SEND_WR_BASE = 1 << 20    # wr_id of reply slot i: SEND_WR_BASE + i
DEDUP_WAIT = 1.0          # seconds a repeat waits for its first attempt (another plane's) to end


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
                 staging_bytes: int, staging_access: int, peer: verbs.QPInfo, peer_name: str) -> None:
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
        dev = device
        self.ep = RcEndpoint(dev, (NOTICE_SLOT + 1) * MSG_BYTES, sq_depth=SEND_DEPTH, recv_slots=RECV_DEPTH,
                             slot_bytes=MSG_BYTES, recv_wr_base=RECV_WR_BASE, cq_depth=CQ_DEPTH)
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
        n = rdma_wire.pack_reply(self.ep.slot(index), req_id, status, message)
        self.ep.post(SEND_WR_BASE + (NOTICE_SLOT if notice else slot), True, "send",
                     self.ep.base + index * MSG_BYTES, n)

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
            if wc.wr_id >= SEND_WR_BASE or self.doomed:
                continue
            self._serve(wc.wr_id - RECV_WR_BASE, wc.byte_len)
        return len(wcs)

    def _serve(self, slot: int, nbytes: int) -> None:
        try:
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
    def payload(self, length: int) -> Iterator[_StagingPayload]:
        """The request's operand: ``length`` bytes of the staging area, where the
        client wrote them (no copy)."""
        if length == 0:   # SCALE: no operand
            yield _StagingPayload(memoryview(b""))
            return
        area = self.staging
        if area is None:
            raise ReadOnly("no writing ticket was presented on this queue pair (no staging area)")
        at = self._staging_at
        if at < 0 or at + length > area.length:
            raise OutOfRange(f"staging range [{at}, {at + length}) outside the "
                             f"{area.length}-byte staging area")
        yield _StagingPayload(area.view[at:at + length])

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
        """Destroy the endpoint (QP first), then the staging area (progress thread or
        the plane's close)."""
        self.ep.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class _StagingPayload:
    """A request's operand in the staging area, handed out whole (:class:`.peer.Payload`)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.step = max(1, len(view))
        self._pos = 0

    def take(self, n: int) -> memoryview:
        chunk = self.view[self._pos:self._pos + n]
        self._pos += n
        return chunk

    def into(self, view: memoryview) -> None:
        view[:] = self.take(len(view))
