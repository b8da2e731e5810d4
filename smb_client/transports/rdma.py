"""The rdma data plane: RC queue pairs to a memory server, set up through its
``Connect`` gRPC call (``rdma://host:port`` names that gRPC service).

* ``read_into``/``write``: one-sided RDMA READ/WRITE between the caller's buffers and
  the extent's registration, split at the device's largest message, pipelined with a
  window of outstanding work requests (reads and atomics at most ``max_rd_atomic``),
  a completion requested every :data:`SIGNAL_EVERY` requests and for the last one.
* ``fetch_add``/``compare_swap``: RDMA atomics on 8-byte aligned words. Soft-RoCE
  (rxe) makes them atomic only against other rxe atomics, not against the server's
  CPU (accumulate) or plain writes to the same word.
* ``accumulate``/``axpy``/``scale``: two-sided (:mod:`smb_client.rdma_wire`): the
  operand is RDMA-written into the connection's staging area on the server, then a
  small SEND asks the server to compute; its reply SEND ends the step. Operands
  larger than half the staging area go in chunks, two in flight.

Caller buffers are registered zero copy through a process-wide registration cache
keyed by the owning object (numpy array, mmap, torch storage): the whole owner is
registered once (page-aligned) and reused while the owner lives. Buffers without a
weak-referenceable owner (bytes, bytearray) go through a registered bounce buffer
when small, or a registration for the one operation when large.

Queue pairs are used by one operation at a time; a session keeps a small pool
(``connections`` option). An error completion breaks only its queue pair: it becomes
a typed exception (remote access error: :class:`ReadOnly` for writes through a
read-only ticket, :class:`ExtentNotFound` once the region was deleted; retries
exceeded: :class:`ServerUnavailable`), the queue pair is destroyed and the next
operation connects again (once transparently, for errors a new ``Connect`` can fix).

pyverbs calls hold the GIL, so completion queues are polled with back-off (spin,
then yield, then naps) rather than blocking on completion events.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import queue
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import rdma_wire, rpc, verbs
from ..addressing import Endpoint, format_hostport
from ..dtypes import DType, itemsize
from ..errors import (
    ExtentNotFound, InvalidArgument, Misaligned, OutOfRange, ProtocolError, ReadOnly, SMBError,
    ServerError, ServerUnavailable, Timeout, status_error,
)
from ..rdma_wire import MSG_BYTES, MsgOp
from . import Session, register

if not verbs.pyverbs_available():  # the registry skips this transport (see __init__)
    raise ImportError("pyverbs is not installed (Debian/Ubuntu: apt-get install python3-pyverbs)")

log = logging.getLogger(__name__)

SQ_DEPTH = 256            # send queue entries per QP
RECV_DEPTH = 8            # reply slots per QP (>= requests in flight + 1)
CQ_DEPTH = SQ_DEPTH + 2 * RECV_DEPTH
WINDOW = 128              # RDMA WRITEs in flight per operation (<= SQ_DEPTH)
SIGNAL_EVERY = 32         # request a completion every this many work requests
STAGING_SLOTS = 2         # arithmetic chunks in flight (staging split in this many slots)
BOUNCE_BYTES = 1 << 20    # registered bounce buffer per QP, bytes
BOUNCE_MAX = 64 << 10     # buffers up to this size (without a cacheable owner) are bounced
REG_CACHE_BYTES = 4 << 30  # registered bytes kept in the cache before evicting
REG_CACHE_ENTRIES = 1024
OP_TIMEOUT = 30.0         # seconds an operation may wait for completions
CONNECT_TIMEOUT = 10.0    # seconds for the Connect call (option connect_timeout, env below)
ENV_CONNECT_TIMEOUT = "SMB_RDMA_CONNECT_TIMEOUT"
POLL_BATCH = 32
SPIN_POLLS = 4            # empty polls before yielding the GIL
YIELD_POLLS = 8           # empty polls with sleep(0) before napping
NAP_FIRST = 10e-6         # seconds
NAP_MAX = 500e-6          # seconds
PAGE = mmap.PAGESIZE
ATOMIC_SLOTS = PAGE // 8  # 8-byte result slots for atomics in flight (one page per QP)
_I64 = struct.Struct("<q")
_U64_MASK = (1 << 64) - 1
RECV_WR_BASE = 1 << 40    # wr_id of receive slot i: RECV_WR_BASE + i (sends use sequence numbers)


# -- process-wide device and registration cache ---------------------------------------
@dataclass
class _Reg:
    """One cached registration of a whole owner (page-aligned)."""

    start: int
    end: int
    mr: Any
    writable: bool
    ref: Any                      # weakref to the owner
    users: int = 0
    dead: bool = False
    last_used: float = field(default_factory=time.monotonic)


class RegistrationCache:
    """Memory registrations of caller buffers, keyed by the owning object.

    Thread-safe. An entry lives while its owner does (a weak reference tells), is
    pinned by :meth:`acquire` until :meth:`release`, and is evicted least recently
    used beyond ``max_bytes``/``max_entries``. Owned by the process's :class:`_Shared`.
    """

    def __init__(self, device: verbs.Device, max_bytes: int = REG_CACHE_BYTES,
                 max_entries: int = REG_CACHE_ENTRIES) -> None:
        import pyverbs.enums as e
        self.device = device
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._rw = e.IBV_ACCESS_LOCAL_WRITE
        self._lock = threading.Lock()
        self._by_owner: dict[int, _Reg] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def acquire(self, owner: Any, start: int, end: int, writable: bool) -> _Reg | None:
        """A registration covering ``[start, end)`` of ``owner`` (held until released);
        None when the owner cannot be weakly referenced or registration fails."""
        key = id(owner)
        with self._lock:
            reg = self._by_owner.get(key)
            if reg is not None:
                if (reg.ref() is owner and not reg.dead and reg.start <= start and end <= reg.end
                        and (reg.writable or not writable)):
                    reg.users += 1
                    reg.last_used = time.monotonic()
                    self.hits += 1
                    return reg
                self._drop_locked(key, reg)
            self.misses += 1
        try:
            ref = weakref.ref(owner, lambda _r, k=key: self._owner_died(k))
        except TypeError:
            return None
        pstart = start - start % PAGE
        pend = -(-end // PAGE) * PAGE
        try:
            mr = self.device.create_mr(pstart, pend - pstart, self._rw if writable else 0)
        except Exception as exc:
            if writable:
                log.debug("cannot register %d bytes writable: %s", pend - pstart, exc)
                return None
            try:  # some read-only mappings only register page-exact
                mr = self.device.create_mr(start, end - start, 0)
                pstart, pend = start, end
            except Exception as exc2:
                log.debug("cannot register %d bytes: %s", end - start, exc2)
                return None
        reg = _Reg(pstart, pend, mr, writable, ref, users=1)
        with self._lock:
            old = self._by_owner.get(key)
            if old is not None:
                self._drop_locked(key, old)
            self._by_owner[key] = reg
            self._bytes += pend - pstart
            self._evict_locked()
        return reg

    def release(self, reg: _Reg) -> None:
        with self._lock:
            reg.users -= 1
            if reg.users == 0 and reg.dead:
                reg.mr.close()

    def _owner_died(self, key: int) -> None:
        with self._lock:
            reg = self._by_owner.get(key)
            if reg is not None and reg.ref() is None:
                self._drop_locked(key, reg)

    def _drop_locked(self, key: int, reg: _Reg) -> None:
        if self._by_owner.get(key) is reg:
            del self._by_owner[key]
            self._bytes -= reg.end - reg.start
        if not reg.dead:
            reg.dead = True
            if reg.users == 0:
                reg.mr.close()

    def _evict_locked(self) -> None:
        if self._bytes <= self.max_bytes and len(self._by_owner) <= self.max_entries:
            return
        for key, reg in sorted(self._by_owner.items(), key=lambda kv: kv[1].last_used):
            if self._bytes <= self.max_bytes and len(self._by_owner) <= self.max_entries:
                break
            if reg.users == 0:
                self._drop_locked(key, reg)

    def close(self) -> None:
        with self._lock:
            regs, self._by_owner = list(self._by_owner.values()), {}
            self._bytes = 0
        for reg in regs:
            if not reg.dead:
                reg.dead = True
                reg.mr.close()


class _Shared:
    """The process's open device and registration cache (closed at exit)."""

    _lock = threading.Lock()
    _instances: dict[str, "_Shared"] = {}

    def __init__(self, name: str | None) -> None:
        self.device = verbs.Device(name)
        self.cache = RegistrationCache(self.device)

    @classmethod
    def get(cls, name: str | None = None) -> "_Shared":
        """The shared device ``name`` (default ``$SMB_RDMA_DEVICE`` or the first active)."""
        name = name or os.environ.get(verbs.ENV_DEVICE) or None
        key = name or ""
        with cls._lock:
            inst = cls._instances.get(key)
            if inst is None:
                inst = cls._instances[key] = _Shared(name)
            return inst

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            insts, cls._instances = list(cls._instances.values()), {}
        for inst in insts:
            inst.cache.close()
            try:
                inst.device.close()
            except Exception as exc:  # a session still holds children
                log.debug("rdma device not closed at exit: %s", exc)


atexit.register(_Shared.close_all)


def _address(view: memoryview) -> int:
    """Virtual address of a non-empty buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)


def _owner(view: memoryview) -> tuple[Any, int, int] | None:
    """(owner, start address, end address) of the memory behind ``view``, for owners
    whose lifetime says whether the memory is still theirs; None otherwise."""
    obj = view.obj
    while isinstance(obj, np.ndarray):
        base = obj.base
        if base is None:
            start = int(obj.ctypes.data)
            return obj, start, start + obj.nbytes
        if isinstance(base, np.ndarray):
            obj = base
            continue
        if isinstance(base, mmap.mmap):
            start = int(np.frombuffer(base, np.uint8, count=1).ctypes.data)
            return base, start, start + len(base)
        if type(base).__module__.startswith("torch"):
            storage = base.untyped_storage()
            start = int(storage.data_ptr())
            return storage, start, start + storage.nbytes()
        return None
    if isinstance(obj, mmap.mmap):
        start = int(np.frombuffer(obj, np.uint8, count=1).ctypes.data)
        return obj, start, start + len(obj)
    return None


# -- errors ---------------------------------------------------------------------------
class _Broken(Exception):
    """An error completion: the QP is unusable. ``error`` is what the caller sees;
    ``reconnect`` says whether a fresh Connect may fix it (retry once)."""

    def __init__(self, error: SMBError, reconnect: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.reconnect = reconnect


# -- one queue pair -------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteExtent:
    address: int
    rkey: int
    length: int          # bytes


class _Conn:
    """One connected RC queue pair with its CQ, message slots and bounce buffer.

    Used by one operation at a time (the session's pool hands it out). Owns its
    verbs objects; :meth:`close` destroys the QP, then buffers, then the CQ.
    """

    def __init__(self, session: "RdmaSession") -> None:
        import pyverbs.enums as e
        from pyverbs.wr import RecvWR, SGE
        self.e = e
        self.session = session
        shared = session.shared
        dev = shared.device
        self.device = dev
        self.where = session.where
        self.cq = dev.create_cq(CQ_DEPTH)
        self.qp: Any = None
        self.mr: Any = None
        self.broken = False
        msgs = 2 * RECV_DEPTH * MSG_BYTES
        self._atomic_off = msgs
        self._bounce_off = msgs + PAGE
        self._mm = mmap.mmap(-1, self._bounce_off + BOUNCE_BYTES)
        self.view = memoryview(self._mm)
        self.base = int(np.frombuffer(self._mm, np.uint8, count=1).ctypes.data)
        try:
            self.mr = dev.create_mr(self.base, len(self._mm), e.IBV_ACCESS_LOCAL_WRITE)
            self.lkey = self.mr.lkey
            self.qp = dev.create_qp(self.cq, SQ_DEPTH, RECV_DEPTH)
            self.psn = verbs.random_psn()
            self.sge = SGE(self.base, 0, self.lkey)           # reused for every post
            self._recv_wrs = [RecvWR(wr_id=RECV_WR_BASE + i, num_sge=1,
                                     sg=[SGE(self.base + i * MSG_BYTES, MSG_BYTES, self.lkey)])
                              for i in range(RECV_DEPTH)]
            self._connect()
        except BaseException:
            self.close()
            raise
        self.seq = 0              # sequence number of the last posted send WR
        self.done = 0             # sequence number of the last completed send WR
        self.replies: dict[int, tuple[int, str]] = {}
        self._req_ids = 0
        self._send_slot = 0

    def _connect(self) -> None:
        from .._proto.smb.v1 import memory_server_pb2 as pb
        from .._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
        s = self.session
        local = self.device.local_info(self.qp, self.psn)
        stub = pb_grpc.MemoryServerStub(s.channel())
        resp = rpc.call(stub.Connect, pb.ConnectRequest(
            ticket=s.ticket, qpn=local.qpn, psn=local.psn, gid=local.gid, mtu=local.mtu, lid=0),
            s.token, s.connect_timeout, ServerUnavailable)
        remote = verbs.QPInfo(resp.qpn, resp.psn, bytes(resp.gid), resp.mtu, resp.lid)
        self.mtu = verbs.negotiate_mtu(local.mtu, remote.mtu)
        if self.mtu != resp.mtu:
            raise ProtocolError(f"{self.where}: server chose MTU {resp.mtu}, expected {self.mtu}")
        e = self.e
        rd = self.device.rd_atomic()
        verbs.connect_qp(self.device, self.qp, self.psn, remote, self.mtu,
                         e.IBV_ACCESS_LOCAL_WRITE, rd)
        self.rd_atomic = rd
        for wr in self._recv_wrs:
            self.qp.post_recv(wr)
        self.extents = {x.extent_id: RemoteExtent(x.address, x.rkey, x.length) for x in resp.extents}
        self.staging = (resp.staging_address, resp.staging_rkey, resp.staging_length)
        self.max_msg = max(PAGE, min(self.device.info.max_msg, s.max_message or 1 << 30))
        log.debug("%s: QP %d connected to %d (MTU %d, %d extents)", self.where, local.qpn,
                  remote.qpn, self.mtu, len(self.extents))

    # -- completions --------------------------------------------------------------------
    def _fail(self, wc: Any, what: str) -> _Broken:
        e = self.e
        self.broken = True
        name = verbs.wc_status_name(wc.status)
        s = self.session
        # READ/WRITE may run again on a fresh QP; an atomic or a request whose fate is
        # unknown (it may have been executed, only the answer lost) may not
        again = what in ("read", "write")
        if (wc.status in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR)
                and what in ("write", "atomic") and s.mode == "ro"):
            # the QP grants REMOTE_READ only and the rkey is of a read-only registration
            return _Broken(ReadOnly(f"{self.where}: the server refused a remote {what}: "
                                    "the region was opened read-only"), False)
        if wc.status == e.IBV_WC_REM_ACCESS_ERR:
            return _Broken(ExtentNotFound(f"{self.where}: remote access refused ({name}): the "
                                          "extent is no longer registered (region deleted?)"), True)
        if wc.status in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR):
            return _Broken(ServerUnavailable(f"{self.where}: no answer from the server ({name}); "
                                             "it died, or dropped this connection"), again)
        if wc.status == e.IBV_WC_REM_INV_REQ_ERR:
            return _Broken(OutOfRange(f"{self.where}: the server refused the request ({name})"), False)
        if wc.status == e.IBV_WC_WR_FLUSH_ERR:
            return _Broken(ServerUnavailable(f"{self.where}: queue pair flushed ({name})"), again)
        return _Broken(ServerError(f"{self.where}: {what} failed: {name} (vendor error "
                                   f"{getattr(wc, 'vendor_err', 0)})"), again)

    def _poll(self, what: str) -> int:
        """Take completions; updates ``done`` and ``replies``; raises _Broken."""
        n, wcs = self.cq.poll(POLL_BATCH)
        if not n:
            return 0
        e = self.e
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise self._fail(wc, what)
            if wc.wr_id >= RECV_WR_BASE:
                slot = wc.wr_id - RECV_WR_BASE
                try:
                    req_id, status, message = rdma_wire.unpack_reply(
                        self.view[slot * MSG_BYTES:(slot + 1) * MSG_BYTES])
                except ValueError as exc:
                    self.broken = True
                    raise _Broken(ProtocolError(f"{self.where}: {exc}"), True) from None
                if req_id == 0:  # the server's notice: it is dropping this QP
                    self.broken = True
                    raise _Broken(status_error(status, f"{self.where}: {message}"), True)
                self.qp.post_recv(self._recv_wrs[slot])
                self.replies[req_id] = (status, message)
            elif wc.wr_id > self.done:
                self.done = wc.wr_id
        return n

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
                raise _Broken(Timeout(f"{self.where}: {what} did not complete within {OP_TIMEOUT} s"),
                              what in ("read", "write"))
            time.sleep(nap)
            nap = min(NAP_MAX, nap * 2)

    # -- posting --------------------------------------------------------------------------
    def post_rdma(self, wrs: Sequence[tuple[int, int, int, int, int]], read: bool) -> None:
        """Post (local address, lkey, length, remote address, rkey) RDMA READs or WRITEs,
        pipelined, and wait until all completed."""
        qp = self.qp
        e = self.e
        sge = self.sge
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
            self.wait(lambda: self.done >= last or (i < total and self.seq - self.done < window), what)

    def atomics(self, rext: RemoteExtent, ops: Sequence[tuple[int, int, int | None]]) -> list[int]:
        """RDMA atomics ``(offset, compare_add, swap or None for fetch-add)`` on words of
        ``rext``, pipelined: up to ``rd_atomic`` in flight, each landing in its own result
        slot. Returns the old values (signed), in order. Executed in order, but not atomic
        as a group."""
        qp = self.qp
        e = self.e
        sge = self.sge
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
            self.wait(lambda: self.done >= last or (i < len(ops) and self.seq - self.done < window),
                      "atomic")
        for k in range(max(0, len(ops) - window), len(ops)):
            take(k)
        return olds

    def send_request(self, op: int, extent_id: int = 0, offset: int = 0, length: int = 0,
                     dtype: int = 0, staging_offset: int = 0, alpha: float = 0.0,
                     writes: Sequence[tuple[int, int, int, int, int]] = (), signaled: bool = True) -> int:
        """Post the operand WRITEs then the request SEND in one batch; returns the
        request id (its reply lands in ``replies``)."""
        qp = self.qp
        e = self.e
        sge = self.sge
        self._req_ids = (self._req_ids + 1) & 0xFFFFFFFF
        req_id = self._req_ids
        slot = RECV_DEPTH + self._send_slot
        self._send_slot = (self._send_slot + 1) % RECV_DEPTH
        rdma_wire.pack_request(self.view[slot * MSG_BYTES:(slot + 1) * MSG_BYTES], op, req_id,
                               extent_id, offset, length, dtype, staging_offset, alpha)
        need = len(writes) + 1
        last = self.seq + need
        self.wait(lambda: self.seq + need - self.done <= SQ_DEPTH, "send")
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
        sge.addr, sge.length, sge.lkey = self.base + slot * MSG_BYTES, rdma_wire.REQUEST.size, self.lkey
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
        if self.broken or self.qp is None:
            return
        try:
            self.send_request(MsgOp.BYE, signaled=True)
            seq = self.seq
            self.wait(lambda: self.done >= seq, "bye")
        except (_Broken, Exception) as exc:
            log.debug("%s: BYE not delivered: %s", self.where, exc)

    def extent(self, extent_id: int) -> RemoteExtent:
        try:
            return self.extents[extent_id]
        except KeyError:
            raise _Broken(ExtentNotFound(f"{self.where}: extent {extent_id} is not offered to this "
                                         "ticket (region deleted, or not on this server)"), True) from None

    def close(self) -> None:
        """Destroy the QP, the registration, then the CQ (idempotent)."""
        if self.qp is not None:
            try:
                self.qp.close()
            finally:
                self.qp = None
        if self.mr is not None:
            self.mr.close()
            self.mr = None
        if self.cq is not None:
            self.cq.close()
            self.cq = None
        try:
            self.view.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass


# -- the session ----------------------------------------------------------------------
class RdmaSession(Session):
    """RC queue pairs (up to ``connections``) to one memory server under one ticket.

    ``endpoint``: ``rdma://host:port`` of the server's gRPC service. Options:
    ``connections`` (queue pairs, default 2), ``token`` (bearer token), ``device``
    (RDMA device name; default ``$SMB_RDMA_DEVICE`` or the first active one),
    ``connect_timeout`` (seconds for the queue-pair exchange; default
    ``$SMB_RDMA_CONNECT_TIMEOUT`` or :data:`CONNECT_TIMEOUT`), ``max_message`` (bytes
    per work request; default the device's maximum message size: transfers are split
    into work requests of at most this many bytes and pipelined). Owns its
    queue pairs and gRPC channel; the device and the registration cache are shared by
    the process.
    """

    scheme = "rdma"

    def __init__(self, endpoint: Endpoint, ticket: str, mode: str = "rw", options: dict | None = None) -> None:
        options = options or {}
        self.endpoint = endpoint
        self.where = str(endpoint)
        self.ticket = ticket
        self.mode = mode
        self.token = options.get("token") or None
        self.max_connections = max(1, int(options.get("connections", 2)))
        self.max_message = int(options.get("max_message") or 0)
        if self.max_message < 0:
            raise InvalidArgument(f"max_message must be a positive number of bytes, not {self.max_message}")
        self.connect_timeout = float(options.get("connect_timeout")
                                     or os.environ.get(ENV_CONNECT_TIMEOUT) or CONNECT_TIMEOUT)
        self.shared = _Shared.get(options.get("device") or None)
        self._channel: Any = None
        self._idle: queue.LifoQueue[_Conn] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._open = 0
        self._closed = False

    def channel(self) -> Any:
        """The gRPC channel to the server's ``Connect`` (opened on first use, owned)."""
        with self._lock:
            if self._channel is None:
                self._channel = rpc.channel(format_hostport(self.endpoint.host, self.endpoint.port))
            return self._channel

    # -- pool -----------------------------------------------------------------------------
    def _acquire(self) -> _Conn:
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._closed:
                    raise ServerUnavailable(f"session to {self.where} is closed")
                grow = self._open < self.max_connections
                if grow:
                    self._open += 1
            if grow:
                break
            try:
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue
        try:
            return _Conn(self)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def _release(self, conn: _Conn) -> None:
        if conn.broken or self._closed:
            conn.close()
            with self._lock:
                self._open -= 1
        else:
            self._idle.put(conn)

    def _do(self, fn: Callable[[_Conn], Any]) -> Any:
        """Run ``fn`` on a queue pair; on an error completion, drop the QP and, when a
        new Connect may help, run it once more on a fresh one."""
        for attempt in (0, 1):
            conn = self._acquire()
            try:
                return fn(conn)
            except _Broken as exc:
                conn.broken = True
                if attempt == 0 and exc.reconnect:
                    log.info("%s: %s; connecting again", self.where, exc.error)
                    self._release(conn)
                    conn = None  # type: ignore[assignment]
                    self._drain_idle()
                    continue
                raise exc.error from None
            finally:
                if conn is not None:
                    self._release(conn)
        raise AssertionError("unreachable")

    def _drain_idle(self) -> None:
        """Idle QPs were set up with the same keys: after a remote error they are
        suspect too; close them so the retry starts clean."""
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                return
            conn.broken = True
            self._release(conn)

    # -- local buffers ----------------------------------------------------------------------
    def _local(self, conn: _Conn, buffers: Sequence[memoryview], for_read: bool,
               held: list[Any], temps: list[Any], bounced: list[tuple[int, memoryview]]
               ) -> list[tuple[int, int, int]]:
        """(address, lkey, length) of each buffer: cached registration, bounce buffer
        (copied in for writes; ``bounced`` lists copies back for reads) or a
        registration for this operation only (in ``temps``)."""
        out = []
        bounce_used = 0
        cache = self.shared.cache
        for b in buffers:
            n = len(b)
            if n == 0:
                continue
            owned = _owner(b)
            if owned is not None and n > BOUNCE_MAX:
                reg = cache.acquire(owned[0], owned[1], owned[2], for_read)
                if reg is not None:
                    held.append(reg)
                    out.append((_address(b), reg.mr.lkey, n))
                    continue
            if n <= BOUNCE_MAX and bounce_used + n <= BOUNCE_BYTES:
                off = conn._bounce_off + bounce_used
                bounce_used += n
                if for_read:
                    bounced.append((off, b))
                else:
                    conn.view[off:off + n] = b
                out.append((conn.base + off, conn.lkey, n))
                continue
            import pyverbs.enums as e
            addr = _address(b)
            try:
                mr = self.shared.device.create_mr(addr, n, e.IBV_ACCESS_LOCAL_WRITE if for_read else 0)
            except Exception as exc:
                raise InvalidArgument(f"cannot register a {n}-byte buffer for RDMA: {exc}") from None
            temps.append(mr)
            out.append((addr, mr.lkey, n))
        return out

    def _with_local(self, conn: _Conn, buffers: Sequence[memoryview], for_read: bool,
                    body: Callable[[list[tuple[int, int, int]]], Any]) -> Any:
        held: list[Any] = []
        temps: list[Any] = []
        bounced: list[tuple[int, memoryview]] = []
        try:
            local = self._local(conn, buffers, for_read, held, temps, bounced)
            result = body(local)
            for off, b in bounced:
                b[:] = conn.view[off:off + len(b)]
            return result
        finally:
            for reg in held:
                self.shared.cache.release(reg)
            if temps and conn.broken and conn.qp is not None:
                verbs.set_error(conn.qp)  # nothing of a dying QP may still reach these
            for mr in temps:
                mr.close()

    @staticmethod
    def _check(rext: RemoteExtent, extent_id: int, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > rext.length:
            raise OutOfRange(f"range [{offset}, {offset + length}) outside extent {extent_id} "
                             f"of {rext.length} bytes")

    # -- one-sided ------------------------------------------------------------------------
    def _transfer(self, extent_id: int, offset: int, buffers: Sequence[memoryview], read: bool) -> None:
        total = sum(len(b) for b in buffers)

        def run(conn: _Conn) -> None:
            rext = conn.extent(extent_id)
            self._check(rext, extent_id, offset, total)
            if total == 0:
                return

            def body(local: list[tuple[int, int, int]]) -> None:
                wrs = []
                raddr = rext.address + offset
                step = conn.max_msg
                for laddr, lkey, n in local:
                    pos = 0
                    while pos < n:
                        k = min(step, n - pos)
                        wrs.append((laddr + pos, lkey, k, raddr + pos, rext.rkey))
                        pos += k
                    raddr += n
                conn.post_rdma(wrs, read)
            self._with_local(conn, buffers, read, body)
        self._do(run)

    def write(self, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer(extent_id, offset, buffers, read=False)

    def read_into(self, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer(extent_id, offset, buffers, read=True)

    def _atomics(self, extent_id: int, ops: Sequence[tuple[int, int, int | None]]) -> list[int]:
        for offset, _, _ in ops:
            if offset % 8:
                raise Misaligned(f"atomic word offset {offset} is not 8-byte aligned")

        def run(conn: _Conn) -> list[int]:
            rext = conn.extent(extent_id)
            for offset, _, _ in ops:
                self._check(rext, extent_id, offset, 8)
            return conn.atomics(rext, ops)
        return self._do(run)

    def fetch_add(self, extent_id: int, offset: int, value: int) -> int:
        return self._atomics(extent_id, [(offset, int(value), None)])[0]

    def fetch_add_many(self, extent_id: int, items: Sequence[tuple[int, int]]) -> list[int]:
        """All fetch-adds on one queue pair, pipelined (see :meth:`_Conn.atomics`)."""
        return self._atomics(extent_id, [(offset, int(value), None) for offset, value in items])

    def compare_swap(self, extent_id: int, offset: int, expected: int, desired: int) -> int:
        return self._atomics(extent_id, [(offset, int(expected), int(desired))])[0]

    # -- two-sided ------------------------------------------------------------------------
    def accumulate(self, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None) -> None:
        op = MsgOp.ACCUMULATE if alpha is None else MsgOp.AXPY
        size = itemsize(dtype)
        total = sum(len(b) for b in buffers)
        if offset % size or total % size:
            raise Misaligned(f"offset {offset} and length {total} must be multiples of {size}")

        def run(conn: _Conn, state: dict) -> None:
            rext = conn.extent(extent_id)
            self._check(rext, extent_id, offset, total)
            s_addr, s_rkey, s_len = conn.staging
            if not s_len:
                raise ReadOnly(f"{self.where}: the region was opened read-only (no staging area)")
            slot_bytes = (s_len // STAGING_SLOTS) // size * size
            if total == 0:
                return

            def body(local: list[tuple[int, int, int]]) -> None:
                pieces = list(local)
                pending: list[int] = []
                pos = 0
                chunk_no = 0
                while pos < total:
                    n = min(slot_bytes, total - pos)
                    slot = chunk_no % STAGING_SLOTS
                    if len(pending) >= STAGING_SLOTS:
                        conn.take_reply(pending.pop(0), "accumulate")
                    writes = []
                    need = n
                    soff = slot * slot_bytes
                    while need:
                        laddr, lkey, pl = pieces[0]
                        k = min(pl, need, conn.max_msg)
                        writes.append((laddr, lkey, k, s_addr + soff, s_rkey))
                        soff += k
                        need -= k
                        pieces[0] = (laddr + k, lkey, pl - k)
                        if pieces[0][2] == 0:
                            pieces.pop(0)
                    state["sent"] = True
                    pending.append(conn.send_request(op, extent_id, offset + pos, n, int(dtype),
                                                     slot * slot_bytes, alpha or 0.0, writes))
                    pos += n
                    chunk_no += 1
                for req_id in pending:
                    conn.take_reply(req_id, "accumulate")
            self._with_local(conn, buffers, False, body)
        self._do_arith(run)

    def scale(self, extent_id: int, offset: int, length: int, dtype: DType, alpha: float) -> None:
        def run(conn: _Conn, state: dict) -> None:
            rext = conn.extent(extent_id)
            self._check(rext, extent_id, offset, length)
            if not conn.staging[2]:
                raise ReadOnly(f"{self.where}: the region was opened read-only")
            state["sent"] = True
            conn.take_reply(conn.send_request(MsgOp.SCALE, extent_id, offset, length, int(dtype),
                                              0, float(alpha)), "scale")
        self._do_arith(run)

    def _do_arith(self, run: Callable[[_Conn, dict], None]) -> None:
        """Server errors arrive as replies (typed, QP intact); error completions as
        _Broken. Retrying after a request was sent could apply it twice, so only
        failures before the first request (a stale extent map) connect again."""
        def guarded(conn: _Conn) -> None:
            state = {"sent": False}
            try:
                run(conn, state)
            except _Broken as exc:
                if state["sent"]:
                    exc.reconnect = False
                raise
        self._do(guarded)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, self._channel = self._channel, None
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                break
            conn.bye()
            conn.close()
        if channel is not None:
            channel.close()


register("rdma", RdmaSession)
