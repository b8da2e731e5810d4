"""The RDMA data plane of a memory server (pyverbs, RC queue pairs).

Memory: every extent's data is registered twice when the arena creates it (this plane
is an arena listener): an ``rw`` registration (LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE
| REMOTE_ATOMIC) and an ``ro`` one (REMOTE_READ only). When an extent is released, the
queue pairs of every connection that may reach it are moved to ERROR and both
registrations are deregistered *before* the arena punches out and unmaps its pages, so
old rkeys stop working and can never reach memory handed to someone else later.

Connections: :meth:`RdmaPlane.connect` serves the ``Connect`` gRPC call. It takes a
verified ticket and the client's :class:`~smb_client.verbs.QPInfo`, creates a queue
pair (remote rights: READ only for ``ro`` tickets), a staging area of
:data:`STAGING_BYTES` for ``rw`` tickets and :data:`RECV_DEPTH` message slots, and
answers with its own QPN/PSN/GID, the negotiated MTU and, for each extent of the
ticket's region held here, the address and the rkey of the registration matching the
ticket's mode.

One-sided READ/WRITE and atomics never involve this process's CPU. Server-side
arithmetic is two-sided (:mod:`smb_client.rdma_wire`): the client writes the operand
into staging and SENDs a request; the progress thread computes with
:mod:`.kernels` under the extent's lock and SENDs the reply.

Threads: one progress thread polls every connection's completion queue with back-off
(pyverbs calls keep the GIL, so nothing blocks in verbs) and alone destroys
connections; other threads only mark them doomed (and move their QP to ERROR).
Connections end on the client's BYE, on an error completion, when their ticket
expires, or when an extent they reach is released. In the last two cases the server
first SENDs an unsolicited *notice* (a reply with ``req_id`` 0 and the error's status)
so the client fails at once with a typed error instead of waiting for transport
retries (rxe does not always report them when the peer QP is gone).
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from smb_client import rdma_wire, verbs
from smb_client.dtypes import FLOATING, STORAGE
from smb_client.errors import (
    DtypeError, ExtentNotFound, InvalidArgument, Misaligned, OutOfMemory, OutOfRange, ReadOnly, SMBError,
    Status, TicketExpired, error_status,
)
from smb_client.rdma_wire import MSG_BYTES, MsgOp
from smb_client.tickets import Ticket

from . import kernels
from .arena import Arena, Extent
from .tcp_plane import PlaneStats, check_access

log = logging.getLogger(__name__)

STAGING_BYTES = 4 << 20   # bytes of operand staging per rw connection
RECV_DEPTH = 16           # request slots (posted receives) per connection
SEND_DEPTH = 2 * RECV_DEPTH
CQ_DEPTH = 4 * RECV_DEPTH
POLL_BATCH = 16           # completions taken per poll
SPIN_POLLS = 64           # empty polls before the progress thread starts to nap
NAP_FIRST = 20e-6         # seconds, first nap when idle
NAP_MAX = 2e-3            # seconds, longest nap when idle
REAP_INTERVAL = 1.0       # seconds between checks for expired tickets
NOTICE_GRACE = 0.2        # seconds a doomed connection waits for its notice to go out
NOTICE_SLOT = 2 * RECV_DEPTH  # message slot of the server's unsolicited notice
RECV_WR_BASE = 0          # wr_id of receive slot i: i
SEND_WR_BASE = 1 << 20    # wr_id of reply slot i: SEND_WR_BASE + i


def access_flags() -> tuple[int, int, int]:
    """(rw registration, ro registration, staging) access flags."""
    import pyverbs.enums as e
    rw = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
          | e.IBV_ACCESS_REMOTE_ATOMIC)
    return rw, e.IBV_ACCESS_REMOTE_READ, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE


def _op_name(op: int) -> str:
    """The metrics label of a two-sided request (``accumulate``, ``axpy``, ``scale``)."""
    try:
        return MsgOp(op).name.lower()
    except ValueError:
        return "unknown"


@dataclass
class _Registration:
    """The two registrations of one extent (owned by the plane)."""

    extent: Extent
    address: int
    rw: Any
    ro: Any

    def close(self) -> None:
        for mr in (self.rw, self.ro):
            try:
                mr.close()
            except Exception as exc:
                log.warning("extent %d: deregistration failed: %s", self.extent.extent_id, exc)


class _Buffer:
    """Anonymous, page-aligned memory registered with the device (owned; MR closed first)."""

    def __init__(self, device: verbs.Device, length: int, access: int) -> None:
        self.mm = mmap.mmap(-1, length)
        self.view = memoryview(self.mm)
        self.address = int(np.frombuffer(self.mm, np.uint8, count=1).ctypes.data)
        self.length = length
        self.mr = device.create_mr(self.address, length, access)

    def close(self) -> None:
        self.mr.close()
        self.view.release()
        self.mm.close()


class _Connection:
    """One client queue pair, its message slots and (rw) staging area."""

    def __init__(self, plane: "RdmaPlane", ticket: Ticket, peer: verbs.QPInfo, peer_name: str) -> None:
        from pyverbs.wr import RecvWR, SGE
        import pyverbs.enums as e
        self.plane = plane
        self.ticket = ticket
        self.writable = ticket.mode in ("rw", "admin")
        self.peer = peer_name
        self.extent_ids: set[int] = set()
        self.doomed = ""
        self.notice: tuple[int, str] | None = None   # (status, message) to tell the client
        self.notice_deadline = 0.0                   # monotonic seconds; 0: not sent yet
        self.notice_done = False
        dev = plane.device
        self.cq = dev.create_cq(CQ_DEPTH)
        self.qp: Any = None
        self.msgs: _Buffer | None = None
        self.staging: _Buffer | None = None
        try:
            self.qp = dev.create_qp(self.cq, SEND_DEPTH, RECV_DEPTH)
            self.msgs = _Buffer(dev, (NOTICE_SLOT + 1) * MSG_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
            if self.writable:
                self.staging = _Buffer(dev, plane.staging_bytes, plane.staging_access)
            self.psn = verbs.random_psn()
            self.mtu = verbs.negotiate_mtu(peer.mtu, dev.info.active_mtu)
            remote = (e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
                      if self.writable else e.IBV_ACCESS_REMOTE_READ)
            verbs.connect_qp(dev, self.qp, self.psn, peer, self.mtu, remote, dev.rd_atomic())
            # receive slots, posted once and re-posted as they are consumed (objects reused)
            lkey = self.msgs.mr.lkey
            self._recv_wrs = [RecvWR(wr_id=RECV_WR_BASE + i, num_sge=1,
                                     sg=[SGE(self.msgs.address + i * MSG_BYTES, MSG_BYTES, lkey)])
                              for i in range(RECV_DEPTH)]
            for wr in self._recv_wrs:
                self.qp.post_recv(wr)
            self._sge = SGE(self.msgs.address, MSG_BYTES, lkey)
        except BaseException:
            self.close()
            raise
        self.info = dev.local_info(self.qp, self.psn)
        self.expires_at = ticket.expires_at

    # -- messages -----------------------------------------------------------------------
    def _reply(self, slot: int, req_id: int, status: int, message: str = "", notice: bool = False) -> None:
        import pyverbs.enums as e
        assert self.msgs is not None
        off = (NOTICE_SLOT if notice else RECV_DEPTH + slot) * MSG_BYTES
        n = rdma_wire.pack_reply(self.msgs.view[off:off + MSG_BYTES], req_id, status, message)
        self._sge.addr = self.msgs.address + off
        self._sge.length = n
        qp = self.qp
        qp.wr_start()
        qp.wr_id = SEND_WR_BASE + (NOTICE_SLOT if notice else slot)
        qp.wr_flags = e.IBV_SEND_SIGNALED
        qp.wr_send()
        qp.wr_set_sge(self._sge)
        qp.wr_complete()

    def progress(self) -> int:
        """Poll once and serve what arrived; returns the number of completions."""
        import pyverbs.enums as e
        n, wcs = self.cq.poll(POLL_BATCH)
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
            slot = wc.wr_id - RECV_WR_BASE
            self._serve(slot, wc.byte_len)
        return n

    def _serve(self, slot: int, nbytes: int) -> None:
        assert self.msgs is not None
        view = self.msgs.view[slot * MSG_BYTES:(slot + 1) * MSG_BYTES]
        try:
            op, dtype, req_id, extent_id, offset, length, staging, alpha = rdma_wire.unpack_request(view)
        except (ValueError, Exception) as exc:
            self.doomed = f"malformed message ({nbytes} bytes): {exc}"
            return
        if op == MsgOp.BYE:
            self.doomed = "closed by the client"
            return
        self.qp.post_recv(self._recv_wrs[slot])   # the slot's content is parsed: reuse it
        status, message = Status.OK, ""
        start = time.perf_counter()
        try:
            self._compute(op, dtype, extent_id, offset, length, staging, alpha)
            self.plane.stats.add(operations=1, bytes_accumulated=length if op != MsgOp.SCALE else 0)
        except SMBError as exc:
            status, message = error_status(exc), str(exc)
            self.plane.stats.add(operations=1, errors=1)
            log.debug("rdma %s: %s on extent %d failed: %s", self.peer, op, extent_id, exc)
        except Exception as exc:
            status, message = Status.INTERNAL, f"{type(exc).__name__}: {exc}"
            self.plane.stats.add(operations=1, errors=1)
            log.exception("rdma %s: %s on extent %d failed", self.peer, op, extent_id)
        self._reply(slot, req_id, status, message)
        self.plane.stats.observe(_op_name(op), time.perf_counter() - start)

    def _compute(self, op: int, dtype: int, extent_id: int, offset: int, length: int,
                 staging: int, alpha: float) -> None:
        if op not in (MsgOp.ACCUMULATE, MsgOp.AXPY, MsgOp.SCALE):
            raise InvalidArgument(f"unknown rdma request {op}")
        if not self.writable:
            raise ReadOnly(f"extent {extent_id}: write through a read-only ticket")
        if self.expires_at < time.time():
            raise TicketExpired("ticket expired; open the region again for a fresh one")
        extent = check_access(self.ticket, self.plane.arena, extent_id, write=True)
        extent.check_range(offset, length)
        dt = kernels.element_type(dtype)
        if op != MsgOp.ACCUMULATE and dt not in FLOATING:
            raise DtypeError(f"{MsgOp(op).name.lower()} needs a floating element type, not {dt.name.lower()}")
        size = STORAGE[dt].itemsize
        if offset % size or length % size:
            raise Misaligned(f"offset {offset} and length {length} must be multiples of the "
                             f"{dt.name.lower()} element size ({size} bytes)")
        if op == MsgOp.SCALE:
            src = None
        else:
            assert self.staging is not None
            if staging < 0 or staging + length > self.staging.length:
                raise OutOfRange(f"staging range [{staging}, {staging + length}) outside the "
                                 f"{self.staging.length}-byte staging area")
            src = self.staging.view[staging:staging + length]
        with extent.pin(), extent.lock, extent.data[offset:offset + length] as dst:
            if op == MsgOp.ACCUMULATE:
                kernels.accumulate(dst, src, dt)
            elif op == MsgOp.AXPY:
                kernels.axpy(dst, alpha, src, dt)
            else:
                kernels.scale(dst, alpha, dt)
        if not extent.live:
            raise ExtentNotFound(f"extent {extent_id} was released during the operation")

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
        if self.notice is None or self.qp is None:
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
        """Destroy QP and registrations, then the CQ (progress thread or constructor)."""
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        for buf in (self.staging, self.msgs):
            if buf is not None:
                buf.close()
        self.staging = self.msgs = None
        self.cq.close()


class RdmaPlane:
    """The memory server's verbs resources: device, extent registrations, connections.

    Borrows ``arena`` (registers itself as a listener; :meth:`close` removes it) and
    ``stats``. Owns the device and everything created on it. ``device``: the RDMA
    device name (default ``$SMB_RDMA_DEVICE`` or the first active one);
    ``prefer_ipv4``: use the GID of this address when the device has one.
    """

    def __init__(self, arena: Arena, stats: PlaneStats | None = None, device: str | None = None,
                 prefer_ipv4: str | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        self.arena = arena
        self.stats = stats if stats is not None else PlaneStats("rdma")
        self.device = verbs.Device(device, prefer_ipv4=prefer_ipv4)
        self.rw_access, self.ro_access, self.staging_access = access_flags()
        self.staging_bytes = staging_bytes
        self.closing = False
        self._lock = threading.Lock()
        self._regs: dict[int, _Registration] = {}
        self._conns: list[_Connection] = []
        try:
            arena.add_listener(self)
        except BaseException:
            self._release_all()
            raise
        self._thread = threading.Thread(target=self._progress_loop, name="rdma-progress", daemon=True)
        self._thread.start()
        info = self.device.info
        log.info("rdma data plane on %s: GID index %d (%s), MTU %d, %d extents registered",
                 info.name, info.gid.index, info.gid.ipv4 or verbs.gid_text(info.gid.gid),
                 info.active_mtu, len(self._regs))

    # -- arena listener ---------------------------------------------------------------
    def extent_added(self, extent: Extent) -> None:
        """Register the extent's data (rw and ro); OutOfMemory when pinning fails."""
        address = extent.address
        try:
            rw = self.device.create_mr(address, extent.length, self.rw_access)
        except Exception as exc:
            raise OutOfMemory(f"extent {extent.extent_id}: cannot register {extent.length} bytes "
                              f"with {self.device.name}: {exc} (check `ulimit -l`; run `smb doctor`)") from None
        try:
            ro = self.device.create_mr(address, extent.length, self.ro_access)
        except Exception as exc:
            rw.close()
            raise OutOfMemory(f"extent {extent.extent_id}: cannot register read-only view: {exc}") from None
        with self._lock:
            self._regs[extent.extent_id] = _Registration(extent, address, rw, ro)
        log.debug("extent %d registered: rkey rw %#x ro %#x", extent.extent_id, rw.rkey, ro.rkey)

    def extent_retiring(self, extent: Extent) -> None:
        """Cut every connection that reaches the extent, then deregister it."""
        with self._lock:
            reg = self._regs.pop(extent.extent_id, None)
            if reg is not None and reg.extent is not extent:  # an id reused: not ours
                self._regs[extent.extent_id] = reg
                reg = None
            conns = [c for c in self._conns if extent.extent_id in c.extent_ids]
        for conn in conns:
            conn.doom(f"extent {extent.extent_id} released",
                      ExtentNotFound(f"extent {extent.extent_id} was released (region deleted)"))
        if reg is not None:
            reg.close()
            log.debug("extent %d deregistered", extent.extent_id)

    # -- Connect ------------------------------------------------------------------------
    def connect(self, ticket: Ticket, peer: verbs.QPInfo, peer_name: str = "") -> dict[str, Any]:
        """Set up a queue pair for ``ticket`` towards ``peer``; returns the fields of a
        ``ConnectResponse`` (``extents`` as (extent_id, address, rkey, length) tuples).

        Raises ExtentNotFound when no extent of the ticket's region is held here.
        """
        if self.closing:
            raise ExtentNotFound("the rdma plane is closing")
        if len(peer.gid) != 16:
            raise InvalidArgument(f"Connect: a GID is 16 bytes, got {len(peer.gid)}")
        if ticket.mode not in ("ro", "rw"):
            raise InvalidArgument(f"Connect needs an ro or rw ticket, not {ticket.mode!r}")
        with self._lock:
            regs = [self._regs[e] for e in sorted(ticket.extent_ids)
                    if e in self._regs and self._regs[e].extent.region_uid == ticket.region_uid
                    and self._regs[e].extent.live]
        if not regs:
            raise ExtentNotFound(f"no extent of region {ticket.region_uid!r} on this server "
                                 "(the region was deleted?)")
        conn = _Connection(self, ticket, peer, peer_name)
        conn.extent_ids = {r.extent.extent_id for r in regs}
        with self._lock:
            if self.closing:
                conn.close()
                raise ExtentNotFound("the rdma plane is closing")
            # a release between the lookup and now must cut this connection too
            gone = [r for r in regs if self._regs.get(r.extent.extent_id) is not r]
            self._conns.append(conn)
        if gone:
            conn.doom("extent released during Connect")
            raise ExtentNotFound(f"extent {gone[0].extent.extent_id} was released during Connect")
        self.stats.add(sessions=1)
        writable = ticket.mode == "rw"
        extents = [(r.extent.extent_id, r.address, (r.rw if writable else r.ro).rkey, r.extent.length)
                   for r in regs]
        log.debug("rdma connect %s: qpn %d <-> %d, %s, mtu %d, %d extents", peer_name, conn.info.qpn,
                  peer.qpn, ticket.mode, conn.mtu, len(extents))
        staging = conn.staging
        return {"qpn": conn.info.qpn, "psn": conn.psn, "gid": conn.info.gid, "mtu": conn.mtu, "lid": 0,
                "extents": extents,
                "staging_address": staging.address if staging else 0,
                "staging_rkey": staging.mr.rkey if staging else 0,
                "staging_length": staging.length if staging else 0}

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- progress -----------------------------------------------------------------------
    def _progress_loop(self) -> None:
        idle = 0
        nap = NAP_FIRST
        next_reap = time.monotonic() + REAP_INTERVAL
        while not self.closing:
            with self._lock:
                conns = list(self._conns)
            busy = 0
            for conn in conns:
                try:
                    if not conn.doomed:
                        busy += conn.progress()
                except Exception as exc:
                    log.exception("rdma %s: progress failed", conn.peer)
                    conn.doom(f"progress failed: {exc}")
                if conn.doomed and conn.finish():
                    self._drop(conn)
            now = time.monotonic()
            if now >= next_reap:
                next_reap = now + REAP_INTERVAL
                wall = time.time()
                for conn in conns:
                    if conn.expires_at < wall and not conn.doomed:
                        conn.doom("ticket expired", TicketExpired("ticket expired; open the region again"))
            if busy:
                idle, nap = 0, NAP_FIRST
            else:
                idle += 1
                if idle > SPIN_POLLS:
                    time.sleep(nap)
                    nap = min(NAP_MAX, nap * 2)
                elif idle % 8 == 0:
                    time.sleep(0)

    def _drop(self, conn: _Connection) -> None:
        with self._lock:
            if conn not in self._conns:
                return
            self._conns.remove(conn)
        log.debug("rdma %s: connection closed: %s", conn.peer, conn.doomed)
        try:
            conn.close()
        except Exception:
            log.exception("rdma %s: cannot close connection", conn.peer)
        self.stats.add(sessions=-1)

    # -- lifecycle ----------------------------------------------------------------------
    def _release_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            regs, self._regs = list(self._regs.values()), {}
        for conn in conns:          # children first: QPs and their buffers, CQs ...
            conn.doom("server closing")
            if conn.qp is not None:
                verbs.set_error(conn.qp)
            conn.close()
            self.stats.add(sessions=-1)
        for reg in regs:            # ... extent registrations ...
            reg.close()
        self.device.close()         # ... then PD and context

    def close(self, timeout: float = 5.0) -> None:
        """Stop the progress thread, drop every connection and registration, close the
        device. Extents stay in the arena (unregistered)."""
        if self.closing:
            return
        self.closing = True
        self.arena.remove_listener(self)
        self._thread.join(timeout)
        self._release_all()
        log.info("rdma data plane on %s closed", self.device.name)

    def __enter__(self) -> "RdmaPlane":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
