"""One client queue pair to a memory server, carrying the tickets of several regions.

A :class:`RdmaConnection` is an :class:`~smb_protocol.rdma.endpoint.RcEndpoint` (message
slots, an atomics page and a bounce buffer in its registered buffer) plus what the
server told it: for every ticket presented on it, the extents it may reach (address,
rkey, length) and whether it may write. The first ticket's ``Connect`` call creates the
server's side and connects the queue pair; a later ticket is presented with a
``Connect`` that names the same queue pair (same QPN, PSN and GID), and the server adds
the ticket to that connection (see :mod:`smb_server.memserver.rdma_plane`).

Used by one operation at a time (the session's pool hands it out).
"""
from __future__ import annotations

import logging
import mmap
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from smb_protocol import rdma_wire, rpc
from smb_protocol.errors import (
    ExtentNotFound,
    OutOfRange,
    ProtocolError,
    ReadOnly,
    ServerError,
    ServerUnavailable,
    Timeout,
    status_error,
)
from smb_protocol.rdma import verbs
from smb_protocol.rdma.endpoint import RcEndpoint
from smb_protocol.rdma_wire import MSG_BYTES, MsgOp

from .peer import Broken, Peer, RemoteExtent, TicketKeys

log = logging.getLogger(__name__)

SQ_DEPTH = 256            # send queue entries per QP
RECV_DEPTH = 8            # reply slots per QP (>= requests in flight + 1)
WINDOW = 128              # RDMA WRITEs in flight per operation (<= SQ_DEPTH)
SIGNAL_EVERY = 32         # request a completion every this many work requests
BOUNCE_BYTES = 1 << 20    # registered bounce buffer per QP, bytes
OP_TIMEOUT = 30.0         # seconds an operation may wait for completions
POLL_BATCH = 32
SPIN_POLLS = 4            # empty polls before yielding the GIL
YIELD_POLLS = 8           # empty polls with sleep(0) before napping
NAP_FIRST = 10e-6         # seconds
NAP_MAX = 500e-6          # seconds
PAGE = mmap.PAGESIZE
ATOMIC_SLOTS = PAGE // 8  # 8-byte result slots for atomics in flight (one page per QP)
RECV_WR_BASE = 1 << 40    # wr_id of receive slot i: RECV_WR_BASE + i (sends use sequence numbers)
_I64 = struct.Struct("<q")
_U64_MASK = (1 << 64) - 1


class RdmaConnection:
    """One RC queue pair to ``peer``, with the keys of every ticket presented on it.

    Owns its endpoint; :meth:`close` destroys it. ``closed`` is true once it broke (an
    error completion, a lost reply) or was closed: the pool then drops it.
    """

    def __init__(self, peer: Peer, recv_depth: int = RECV_DEPTH, remote_write: bool = False) -> None:
        self.peer = peer
        self.where = peer.where
        self.recv_depth = recv_depth
        self.remote_write = remote_write   # the server may RDMA-WRITE into this side (sums)
        self._atomic_off = 2 * recv_depth * MSG_BYTES
        self.bounce_off = self._atomic_off + PAGE
        self.ep = RcEndpoint(peer.device, self.bounce_off + BOUNCE_BYTES, sq_depth=SQ_DEPTH,
                             recv_slots=recv_depth, slot_bytes=MSG_BYTES, recv_wr_base=RECV_WR_BASE,
                             cq_depth=SQ_DEPTH + 2 * recv_depth)
        self.view = self.ep.view
        self.base = self.ep.base
        self.lkey = self.ep.lkey
        self.broken = False
        self.remote: verbs.QPInfo | None = None
        self.tickets: dict[str, TicketKeys] = {}
        self.staging = (0, 0, 0)          # (address, rkey, length) on the server; 0: none yet
        self.rd_atomic = 1
        self.max_msg = PAGE
        self.op_writable = True           # the running operation's ticket may write
        self.seq = 0              # sequence number of the last posted send WR
        self.done = 0             # sequence number of the last completed send WR
        self.replies: dict[int, tuple[int, str]] = {}
        self._req_ids = 0
        self._send_slot = 0

    @property
    def closed(self) -> bool:
        return self.broken or self.ep.closed

    # -- tickets --------------------------------------------------------------------------
    def keys(self, token: str) -> TicketKeys:
        """The keys of ticket ``token`` on this QP, presenting it to the server first
        when it is new here (the first one also connects the QP)."""
        keys = self.tickets.get(token)
        if keys is None:
            keys = self._present(token)
        return keys

    def _present(self, token: str) -> TicketKeys:
        from smb_protocol._proto.smb.v1 import memory_server_pb2 as pb
        from smb_protocol._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
        s = self.peer
        local = self.ep.local_info()
        stub = pb_grpc.MemoryServerStub(s.channel())  # type: ignore[no-untyped-call]  # generated stub, untyped __init__
        try:
            resp = rpc.call(stub.Connect, pb.ConnectRequest(
                ticket=token, qpn=local.qpn, psn=local.psn, gid=local.gid, mtu=local.mtu, lid=0),
                s.token, s.connect_timeout, ServerUnavailable)
        except ServerUnavailable as exc:
            if self.remote is None:
                raise
            # the server dropped this queue pair (or is gone): a fresh one must connect
            self.broken = True
            raise Broken(exc, True) from None
        if self.remote is None:
            remote = verbs.QPInfo(resp.qpn, resp.psn, bytes(resp.gid), resp.mtu, resp.lid)
            mtu = verbs.negotiate_mtu(local.mtu, remote.mtu)
            if mtu != resp.mtu:
                self.broken = True
                raise ProtocolError(f"{self.where}: server chose MTU {resp.mtu}, expected {mtu}")
            import pyverbs.enums as e
            dev = self.ep.device
            self.rd_atomic = dev.rd_atomic()
            access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if self.remote_write else 0)
            try:
                self.ep.connect(remote, mtu, access, self.rd_atomic)
            except BaseException:
                self.broken = True
                raise
            self.remote = remote
            self.max_msg = max(PAGE, min(dev.info.max_msg, s.max_message or 1 << 30))
            log.debug("%s: QP %d connected to %d (MTU %d)", self.where, local.qpn, remote.qpn, mtu)
        elif (resp.qpn, resp.psn) != (self.remote.qpn, self.remote.psn):
            # the server no longer knows this QP (it dropped it): a fresh one must connect
            self.broken = True
            raise Broken(ServerUnavailable(f"{self.where}: the server dropped this queue pair"), True)
        keys = TicketKeys({x.extent_id: RemoteExtent(x.address, x.rkey, x.length) for x in resp.extents},
                          writable=resp.staging_length > 0)
        if resp.staging_length:
            self.staging = (resp.staging_address, resp.staging_rkey, resp.staging_length)
        self.tickets[token] = keys
        log.debug("%s: ticket presented on QP %d (%d extents, %s)", self.where, local.qpn,
                  len(keys.extents), "rw" if keys.writable else "ro")
        return keys

    def extent(self, keys: TicketKeys, extent_id: int) -> RemoteExtent:
        try:
            return keys.extents[extent_id]
        except KeyError:
            raise Broken(ExtentNotFound(f"{self.where}: extent {extent_id} is not offered to this "
                                         "ticket (region deleted, or not on this server)"), True) from None

    # -- completions --------------------------------------------------------------------
    def _fail(self, wc: Any, what: str) -> Broken:
        import pyverbs.enums as e
        self.broken = True
        name = verbs.wc_status_name(wc.status)
        # READ/WRITE may run again on a fresh QP; an atomic or a request whose fate is
        # unknown (it may have been executed, only the answer lost) may not
        again = what in ("read", "write")
        if (wc.status in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR)
                and what in ("write", "atomic") and not self.op_writable):
            # the rkey is of the extent's read-only registration
            return Broken(ReadOnly(f"{self.where}: the server refused a remote {what}: "
                                    "the region was opened read-only"), False)
        if wc.status == e.IBV_WC_REM_ACCESS_ERR:
            return Broken(ExtentNotFound(f"{self.where}: remote access refused ({name}): the "
                                          "extent is no longer registered (region deleted?)"), True)
        if wc.status in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR):
            return Broken(ServerUnavailable(f"{self.where}: no answer from the server ({name}); "
                                             "it died, or dropped this connection"), again)
        if wc.status == e.IBV_WC_REM_INV_REQ_ERR:
            return Broken(OutOfRange(f"{self.where}: the server refused the request ({name})"), False)
        if wc.status == e.IBV_WC_WR_FLUSH_ERR:
            return Broken(ServerUnavailable(f"{self.where}: queue pair flushed ({name})"), again)
        return Broken(ServerError(f"{self.where}: {what} failed: {name} (vendor error "
                                   f"{getattr(wc, 'vendor_err', 0)})"), again)

    def _poll(self, what: str) -> int:
        """Take completions; updates ``done`` and ``replies``; raises Broken."""
        import pyverbs.enums as e
        wcs = self.ep.poll(POLL_BATCH)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise self._fail(wc, what)
            if wc.wr_id >= RECV_WR_BASE:
                slot = wc.wr_id - RECV_WR_BASE
                try:
                    req_id, status, message = rdma_wire.unpack_reply(self.ep.slot(slot))
                except ValueError as exc:
                    self.broken = True
                    raise Broken(ProtocolError(f"{self.where}: {exc}"), True) from None
                if req_id == 0:  # the server's notice: it is dropping this QP
                    self.broken = True
                    raise Broken(status_error(status, f"{self.where}: {message}"), True)
                self.ep.repost(slot)
                self.replies[req_id] = (status, message)
            elif wc.wr_id > self.done:
                self.done = wc.wr_id
        return len(wcs)

    def wait(self, until: Callable[[], bool], what: str) -> None:
        """Poll with back-off until ``until()``; Timeout after :data:`OP_TIMEOUT`."""
        idle = 0
        nap = NAP_FIRST
        deadline = 0.0
        while not until():
            if self._poll(what):
                idle, nap = 0, NAP_FIRST
                continue
            idle += 1
            if idle <= SPIN_POLLS:
                continue
            if idle <= SPIN_POLLS + YIELD_POLLS:
                time.sleep(0)
                continue
            if not deadline:
                deadline = time.monotonic() + OP_TIMEOUT
            elif time.monotonic() > deadline:
                self.broken = True
                # READ/WRITE may run again on a fresh QP; atomics and arithmetic may not
                raise Broken(Timeout(f"{self.where}: {what} did not complete within {OP_TIMEOUT} s"),
                              what in ("read", "write"))
            time.sleep(nap)
            nap = min(NAP_MAX, nap * 2)

    # -- posting --------------------------------------------------------------------------
    def post_rdma(self, wrs: Sequence[tuple[int, int, int, int, int]], read: bool) -> None:
        """Post (local address, lkey, length, remote address, rkey) RDMA READs or WRITEs,
        pipelined, and wait until all completed."""
        import pyverbs.enums as e
        qp = self.ep.qp
        sge = self.ep.sge
        window = max(1, min(self.rd_atomic if read else WINDOW, SQ_DEPTH))
        signal = max(1, min(SIGNAL_EVERY, window // 2))
        total = len(wrs)
        first = self.seq + 1
        last = self.seq + total
        i = 0
        what = "read" if read else "write"
        while i < total or self.done < last:
            if i < total and self.seq - self.done < window:
                qp.wr_start()
                while i < total and self.seq - self.done < window:
                    laddr, lkey, n, raddr, rkey = wrs[i]
                    i += 1
                    self.seq += 1
                    qp.wr_id = self.seq
                    qp.wr_flags = e.IBV_SEND_SIGNALED if (i == total or (self.seq - first + 1) % signal == 0) else 0
                    if read:
                        qp.wr_rdma_read(rkey, raddr)
                    else:
                        qp.wr_rdma_write(rkey, raddr)
                    sge.addr, sge.length, sge.lkey = laddr, n, lkey
                    qp.wr_set_sge(sge)
                qp.wr_complete()
                continue
            self.wait(lambda: self.done >= last or (i < total and self.seq - self.done < window), what)  # noqa: B023

    def atomics(self, rext: RemoteExtent, ops: Sequence[tuple[int, int, int | None]]) -> list[int]:
        """RDMA atomics ``(offset, compare_add, swap or None for fetch-add)`` on words of
        ``rext``, pipelined: up to ``rd_atomic`` in flight, each landing in its own result
        slot. Returns the old values (signed), in order. Executed in order, but not atomic
        as a group."""
        import pyverbs.enums as e
        qp = self.ep.qp
        sge = self.ep.sge
        window = max(1, min(self.rd_atomic, ATOMIC_SLOTS, SQ_DEPTH))
        olds = [0] * len(ops)
        last = self.seq + len(ops)
        slots = self.base + self._atomic_off

        def take(k: int) -> None:   # op k completed: its slot is free after this
            olds[k] = _I64.unpack_from(self.view, self._atomic_off + (k % window) * 8)[0]

        i = 0
        while i < len(ops) or self.done < last:
            if i < len(ops) and self.seq - self.done < window:
                qp.wr_start()
                while i < len(ops) and self.seq - self.done < window:
                    if i >= window:
                        take(i - window)
                    offset, compare_add, swap = ops[i]
                    self.seq += 1
                    qp.wr_id = self.seq
                    qp.wr_flags = e.IBV_SEND_SIGNALED
                    if swap is None:
                        qp.wr_atomic_fetch_add(rext.rkey, rext.address + offset, compare_add & _U64_MASK)
                    else:
                        qp.wr_atomic_cmp_swp(rext.rkey, rext.address + offset, compare_add & _U64_MASK,
                                             swap & _U64_MASK)
                    sge.addr, sge.length, sge.lkey = slots + (i % window) * 8, 8, self.lkey
                    qp.wr_set_sge(sge)
                    i += 1
                qp.wr_complete()
                continue
            self.wait(lambda: self.done >= last or (i < len(ops) and self.seq - self.done < window),  # noqa: B023
                      "atomic")
        for k in range(max(0, len(ops) - window), len(ops)):
            take(k)
        return olds

    def send_request(self, op: int, extent_id: int = 0, offset: int = 0, length: int = 0,
                     dtype: int = 0, staging_offset: int = 0, alpha: float = 0.0,
                     writes: Sequence[tuple[int, int, int, int, int]] = (), signaled: bool = True,
                     seq: int = 0) -> int:
        """Post the operand WRITEs then the request SEND in one batch; returns the
        request id (its reply lands in ``replies``). ``seq`` numbers the request for
        exactly-once service (0: not tracked)."""
        def pack(buf: memoryview, req_id: int) -> int:
            rdma_wire.pack_request(buf, op, req_id, extent_id, offset, length, dtype,
                                   staging_offset, alpha, self.peer.client_id if seq else 0, seq)
            return rdma_wire.REQUEST.size
        self.wait(lambda: self.seq + len(writes) + 1 - self.done <= SQ_DEPTH, "send")
        return self.post_message(pack, writes, signaled)

    def next_req_id(self) -> int:
        self._req_ids = (self._req_ids + 1) & 0xFFFFFFFF or 1
        return self._req_ids

    def post_message(self, pack: Callable[[memoryview, int], int],
                     writes: Sequence[tuple[int, int, int, int, int]] = (), signaled: bool = True) -> int:
        """Post ``writes`` (local address, lkey, bytes, remote address, rkey), then SEND
        the message ``pack(slot, req_id)`` writes into a message slot (returning its
        size), in one batch; returns the request id. The caller made room in the send
        queue; message slots are reused after :attr:`recv_depth` more messages."""
        import pyverbs.enums as e
        qp = self.ep.qp
        sge = self.ep.sge
        req_id = self.next_req_id()
        slot = self.recv_depth + self._send_slot
        self._send_slot = (self._send_slot + 1) % self.recv_depth
        size = pack(self.ep.slot(slot), req_id)
        last = self.seq + len(writes) + 1
        qp.wr_start()
        for laddr, lkey, n, raddr, rkey in writes:
            self.seq += 1
            qp.wr_id = self.seq
            qp.wr_flags = 0
            qp.wr_rdma_write(rkey, raddr)
            sge.addr, sge.length, sge.lkey = laddr, n, lkey
            qp.wr_set_sge(sge)
        self.seq += 1
        assert self.seq == last
        qp.wr_id = self.seq
        qp.wr_flags = e.IBV_SEND_SIGNALED if signaled else 0
        qp.wr_send()
        sge.addr, sge.length, sge.lkey = self.base + slot * MSG_BYTES, size, self.lkey
        qp.wr_set_sge(sge)
        qp.wr_complete()
        return req_id

    def take_reply(self, req_id: int, what: str) -> None:
        """Wait for the reply to ``req_id``; raises its typed error."""
        self.wait(lambda: req_id in self.replies, what)
        status, message = self.replies.pop(req_id)
        if status != 0:
            raise status_error(status, f"{self.where}: {message}")

    def bye(self) -> None:
        """Tell the server this QP is done (best effort, no reply)."""
        if self.closed or self.remote is None:
            return
        try:
            self.send_request(MsgOp.BYE, signaled=True)
            seq = self.seq
            self.wait(lambda: self.done >= seq, "bye")
        except (Broken, Exception) as exc:
            log.debug("%s: BYE not delivered: %s", self.where, exc)

    def close(self) -> None:
        """Say BYE when still healthy, then destroy the QP, the buffer and the CQ
        (idempotent)."""
        if not self.ep.closed:
            self.bye()
        self.broken = True
        self.ep.close()
