"""One RC endpoint, the same on both sides of a connection (client queue pair, memory
server connection, ``smb doctor``'s loopback pair): a registered buffer whose first
bytes are message slots, a completion queue, an RC queue pair (extended API) and
posted receives on the first ``recv_slots`` slots.

Built in the order of rdma-core's pyverbs tests (CQ, MR, QP) and closed in reverse
(QP, MR, CQ). The peers swap :meth:`RcEndpoint.local_info` out of band, then each calls
:meth:`RcEndpoint.connect` with the other's.
"""
from __future__ import annotations

import logging
import mmap
from typing import Any

import numpy as np

from smb_protocol.rdma import verbs

log = logging.getLogger(__name__)


class RegisteredBuffer:
    """Anonymous, page-aligned memory registered with ``device`` (owned; the MR is
    closed before the memory is unmapped)."""

    def __init__(self, device: verbs.Device, length: int, access: int) -> None:
        self.mm = mmap.mmap(-1, length)
        self.view = memoryview(self.mm)
        self.address = int(np.frombuffer(self.mm, np.uint8, count=1).ctypes.data)
        self.length = length
        try:
            self.mr = device.create_mr(self.address, length, access)
        except BaseException:
            self.view.release()
            self.mm.close()
            raise

    @property
    def lkey(self) -> int:
        return int(self.mr.lkey)

    @property
    def rkey(self) -> int:
        return int(self.mr.rkey)

    def close(self) -> None:
        if self.mr is None:
            return
        self.mr.close()
        self.mr = None
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):   # a numpy view still exported: unmapped at GC
            pass


class RcEndpoint:
    """An RC queue pair with its CQ, buffer and receive slots (owned, see module doc).

    ``buffer_bytes``: the registered buffer; slot ``i`` is ``[i * slot_bytes, (i + 1) *
    slot_bytes)``; the first ``recv_slots`` slots receive (``wr_id`` ``recv_wr_base +
    i``). ``sq_depth``: send-queue entries. ``access``: the buffer's registration flags
    (default LOCAL_WRITE). Not thread-safe: one user at a time.
    """

    def __init__(self, device: verbs.Device, buffer_bytes: int, *, sq_depth: int, recv_slots: int,
                 slot_bytes: int, recv_wr_base: int = 0, cq_depth: int | None = None,
                 access: int | None = None) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, RecvWR
        self.device = device
        self.slot_bytes = slot_bytes
        self.recv_wr_base = recv_wr_base
        self.buffer: RegisteredBuffer | None = None
        self.qp: Any = None
        self.cq: Any = device.create_cq(cq_depth or sq_depth + 2 * recv_slots)
        try:
            self.buffer = RegisteredBuffer(device, buffer_bytes,
                                           e.IBV_ACCESS_LOCAL_WRITE if access is None else access)
            self.view = self.buffer.view
            self.base = self.buffer.address
            self.lkey = self.buffer.lkey
            self.qp = device.create_qp(self.cq, sq_depth, max(1, recv_slots))
            self.psn = verbs.random_psn()
            self.sge = SGE(self.base, 0, self.lkey)           # reused for every post
            self._recv_wrs = [RecvWR(wr_id=recv_wr_base + i, num_sge=1,
                                     sg=[SGE(self.base + i * slot_bytes, slot_bytes, self.lkey)])
                              for i in range(recv_slots)]
        except BaseException:
            self.close()
            raise
        self.mtu = 0
        self.remote: verbs.QPInfo | None = None

    def local_info(self) -> verbs.QPInfo:
        """What the peer needs to connect to this queue pair."""
        return self.device.local_info(self.qp, self.psn)

    def connect(self, remote: verbs.QPInfo, mtu: int, access: int, rd_atomic: int) -> None:
        """Walk the QP to RTS towards ``remote`` (path MTU ``mtu`` bytes, remote rights
        ``access``) and post every receive slot."""
        verbs.connect_qp(self.device, self.qp, self.psn, remote, mtu, access, rd_atomic)
        self.mtu = mtu
        self.remote = remote
        for wr in self._recv_wrs:
            self.qp.post_recv(wr)

    def slot(self, i: int) -> memoryview:
        return self.view[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def repost(self, i: int) -> None:
        """Post receive slot ``i`` again (its content was consumed)."""
        self.qp.post_recv(self._recv_wrs[i])

    def post(self, wr_id: int, signaled: bool, op: str, laddr: int, length: int, lkey: int | None = None,
             rkey: int = 0, raddr: int = 0) -> None:
        """Post one work request: ``op`` is ``send``, ``write`` or ``read``."""
        import pyverbs.enums as e
        qp = self.qp
        qp.wr_start()
        qp.wr_id = wr_id
        qp.wr_flags = e.IBV_SEND_SIGNALED if signaled else 0
        if op == "send":
            qp.wr_send()
        elif op == "write":
            qp.wr_rdma_write(rkey, raddr)
        else:
            qp.wr_rdma_read(rkey, raddr)
        self.sge.addr, self.sge.length, self.sge.lkey = laddr, length, self.lkey if lkey is None else lkey
        qp.wr_set_sge(self.sge)
        qp.wr_complete()

    def poll(self, n: int) -> list[Any]:
        """Up to ``n`` work completions (never blocks)."""
        got, wcs = self.cq.poll(n)
        return wcs if got else []

    def set_error(self) -> None:
        """Move the QP to ERROR: outstanding work flushes, the peer gets no more service."""
        if self.qp is not None:
            verbs.set_error(self.qp)

    @property
    def closed(self) -> bool:
        return self.qp is None

    def close(self) -> None:
        """Destroy the QP, the buffer's registration, then the CQ (idempotent)."""
        if self.qp is not None:
            try:
                self.qp.close()
            finally:
                self.qp = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self.cq is not None:
            self.cq.close()
            self.cq = None
