"""The rdma session: queue pairs to one memory server, shared by every region of a
client, and the operations on top of them (see the package docstring)."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from smb_protocol import rpc
from smb_protocol.addressing import Endpoint, format_hostport
from smb_protocol.dtypes import DType, itemsize
from smb_protocol.errors import InvalidArgument, Misaligned, OutOfRange, ReadOnly, SMBError
from smb_protocol.rdma_wire import MsgOp

from .. import Session
from ..pool import ConnectionPool
from .connection import BOUNCE_BYTES, RdmaConnection
from .device import SharedDevice
from .peer import Broken, Peer, RemoteExtent, TicketKeys
from .reduce import RECV_DEPTH as REDUCE_RECV_DEPTH
from .reduce import RdmaReduceStream
from .registration import address_of, owner_of

log = logging.getLogger(__name__)

STAGING_SLOTS = 2         # arithmetic chunks in flight (staging split in this many slots)
BOUNCE_MAX = 64 << 10     # buffers up to this size (without a cacheable owner) are bounced
CONNECT_TIMEOUT = 10.0    # seconds for the Connect call (option connect_timeout, env below)
ENV_CONNECT_TIMEOUT = "SMB_RDMA_CONNECT_TIMEOUT"

_Local = list[tuple[int, int, int]]     # (address, lkey, length) of each caller buffer


class RdmaSession(Session):
    """RC queue pairs (up to ``connections``) to one memory server, for every ticket of
    one client; each queue pair carries the tickets presented on it.

    ``endpoint``: ``rdma://host:port`` of the server's gRPC service. Options:
    ``connections`` (queue pairs, default 2), ``grpc_address`` (the server's gRPC
    address; default the endpoint's host:port), ``token`` (bearer token), ``device``
    (RDMA device name; default ``$SMB_RDMA_DEVICE`` or the first active one),
    ``connect_timeout`` (seconds for the queue-pair exchange; default
    ``$SMB_RDMA_CONNECT_TIMEOUT`` or :data:`CONNECT_TIMEOUT`), ``max_message`` (bytes
    per work request; default the device's maximum message size). Owns its queue pairs
    (a pool) and its one gRPC channel; the device and the registration cache are shared
    by the process.
    """

    scheme = "rdma"

    def __init__(self, endpoint: Endpoint, options: dict[str, Any] | None = None) -> None:
        options = options or {}
        self.endpoint = endpoint
        self.where = str(endpoint)
        self.grpc_address = options.get("grpc_address") or format_hostport(endpoint.host, endpoint.port)
        self.token = options.get("token") or None
        self.client_id = int(options.get("client_id", 0))
        self.tls = options.get("tls")   # TLS for the gRPC channel (None: the SMB_TLS_* environment)
        self.max_message = int(options.get("max_message") or 0)
        if self.max_message < 0:
            raise InvalidArgument(f"max_message must be a positive number of bytes, not {self.max_message}")
        self.connect_timeout = float(options.get("connect_timeout")
                                     or os.environ.get(ENV_CONNECT_TIMEOUT) or CONNECT_TIMEOUT)
        self.shared = SharedDevice.get(options.get("device") or None)
        self._channel: Any = None
        self.peer = peer = Peer(self.where, self.shared.device, self.channel, self.token, self.connect_timeout,
                                self.max_message, self.client_id)
        self._stream: RdmaReduceStream | None = None
        self._stream_lock = threading.Lock()
        self.pool: ConnectionPool[RdmaConnection] = ConnectionPool(
            lambda: RdmaConnection(peer), max(1, int(options.get("connections", 2))), self.where)

    def channel(self) -> Any:
        """The gRPC channel to the server's ``Connect`` (opened on first use, owned)."""
        if self._channel is None:
            self._channel = rpc.channel(self.grpc_address, self.tls)
        return self._channel

    # -- running an operation -------------------------------------------------------------
    def _do(self, ticket: str, fn: Callable[[RdmaConnection, TicketKeys], Any]) -> Any:
        """Run ``fn`` on a queue pair that carries ``ticket``; on an error completion,
        drop the QP and, when a new Connect may help, run it again, until a fresh QP was
        tried: the pool's other idle QPs may be broken the same way (the server closes
        every QP that carried a deleted region's ticket), and each failure drops one, so
        after ``pool.size`` of them the pool connects a new one."""
        for attempt in range(self.pool.size + 1):
            conn = self.pool.acquire()
            try:
                keys = conn.keys(ticket)
                conn.op_writable = keys.writable
                return fn(conn, keys)
            except Broken as exc:
                conn.broken = True
                if attempt < self.pool.size and exc.reconnect:
                    log.info("%s: %s; connecting again", self.where, exc.error)
                    continue
                raise exc.error from None
            finally:
                self.pool.release(conn)
        raise AssertionError("unreachable")

    # -- local buffers ----------------------------------------------------------------------
    def _local(self, conn: RdmaConnection, buffers: Sequence[memoryview], for_read: bool,
               held: list[Any], temps: list[Any], bounced: list[tuple[int, memoryview]]) -> _Local:
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
            owned = owner_of(b)
            if owned is not None and n > BOUNCE_MAX:
                reg = cache.acquire(owned[0], owned[1], owned[2], for_read)
                if reg is not None:
                    held.append(reg)
                    out.append((address_of(b), reg.mr.lkey, n))
                    continue
            if n <= BOUNCE_MAX and bounce_used + n <= BOUNCE_BYTES:
                off = conn.bounce_off + bounce_used
                bounce_used += n
                if for_read:
                    bounced.append((off, b))
                else:
                    conn.view[off:off + n] = b
                out.append((conn.base + off, conn.lkey, n))
                continue
            import pyverbs.enums as e
            addr = address_of(b)
            try:
                mr = self.shared.device.create_mr(addr, n, e.IBV_ACCESS_LOCAL_WRITE if for_read else 0)
            except Exception as exc:
                raise InvalidArgument(f"cannot register a {n}-byte buffer for RDMA: {exc}") from None
            temps.append(mr)
            out.append((addr, mr.lkey, n))
        return out

    def _with_local(self, conn: RdmaConnection, buffers: Sequence[memoryview], for_read: bool,
                    body: Callable[[_Local], Any]) -> Any:
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
            if temps and conn.broken:
                conn.ep.set_error()  # nothing of a dying QP may still reach these
            for mr in temps:
                mr.close()

    @staticmethod
    def _check(rext: RemoteExtent, extent_id: int, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > rext.length:
            raise OutOfRange(f"range [{offset}, {offset + length}) outside extent {extent_id} "
                             f"of {rext.length} bytes")

    # -- one-sided ------------------------------------------------------------------------
    def _transfer(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
                  read: bool) -> None:
        total = sum(len(b) for b in buffers)

        def run(conn: RdmaConnection, keys: TicketKeys) -> None:
            rext = conn.extent(keys, extent_id)
            self._check(rext, extent_id, offset, total)
            if total == 0:
                return

            def body(local: _Local) -> None:
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
        self._do(ticket, run)

    def write(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
              seq: int = 0) -> None:
        """One-sided: running it again writes the same bytes (``seq`` unused)."""
        self._transfer(ticket, extent_id, offset, buffers, read=False)

    def read_into(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None:
        self._transfer(ticket, extent_id, offset, buffers, read=True)

    def _atomics(self, ticket: str, extent_id: int, ops: Sequence[tuple[int, int, int | None]]) -> list[int]:
        for offset, _, _ in ops:
            if offset % 8:
                raise Misaligned(f"atomic word offset {offset} is not 8-byte aligned")

        def run(conn: RdmaConnection, keys: TicketKeys) -> list[int]:
            rext = conn.extent(keys, extent_id)
            for offset, _, _ in ops:
                self._check(rext, extent_id, offset, 8)
            return conn.atomics(rext, ops)
        try:
            olds: list[int] = self._do(ticket, run)
        except SMBError as exc:
            # a one-sided atomic carries no request number: whether one that failed took
            # effect is unknown, so nothing above may send it again (smb_client.route)
            exc.outcome_unknown = True   # type: ignore[attr-defined]
            raise
        return olds

    def fetch_add(self, ticket: str, extent_id: int, offset: int, value: int, seq: int = 0) -> int:
        return self._atomics(ticket, extent_id, [(offset, int(value), None)])[0]

    def fetch_add_many(self, ticket: str, extent_id: int, items: Sequence[tuple[int, int]],
                       seq: int = 0) -> list[int]:
        """All fetch-adds on one queue pair, pipelined (see :meth:`RdmaConnection.atomics`)."""
        return self._atomics(ticket, extent_id, [(offset, int(value), None) for offset, value in items])

    def compare_swap(self, ticket: str, extent_id: int, offset: int, expected: int, desired: int,
                     seq: int = 0) -> int:
        return self._atomics(ticket, extent_id, [(offset, int(expected), int(desired))])[0]

    # -- two-sided ------------------------------------------------------------------------
    def accumulate(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None, seq: int = 0) -> None:
        op = MsgOp.ACCUMULATE if alpha is None else MsgOp.AXPY
        size = itemsize(dtype)
        total = sum(len(b) for b in buffers)
        if offset % size or total % size:
            raise Misaligned(f"offset {offset} and length {total} must be multiples of {size}")

        def run(conn: RdmaConnection, keys: TicketKeys, state: dict[str, bool]) -> None:
            rext = conn.extent(keys, extent_id)
            self._check(rext, extent_id, offset, total)
            self._writable(conn, keys)
            s_addr, s_rkey, s_len = conn.staging
            slot_bytes = (s_len // STAGING_SLOTS) // size * size
            if total == 0:
                return

            def body(local: _Local) -> None:
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
                                                     slot * slot_bytes, alpha or 0.0, writes,
                                                     seq=seq + chunk_no if seq else 0))
                    pos += n
                    chunk_no += 1
                for req_id in pending:
                    conn.take_reply(req_id, "accumulate")
            self._with_local(conn, buffers, False, body)
        self._do_arith(ticket, run, seq)

    def scale(self, ticket: str, extent_id: int, offset: int, length: int, dtype: DType, alpha: float,
              seq: int = 0) -> None:
        def run(conn: RdmaConnection, keys: TicketKeys, state: dict[str, bool]) -> None:
            rext = conn.extent(keys, extent_id)
            self._check(rext, extent_id, offset, length)
            self._writable(conn, keys)
            state["sent"] = True
            conn.take_reply(conn.send_request(MsgOp.SCALE, extent_id, offset, length, int(dtype),
                                              0, float(alpha), seq=seq), "scale")
        self._do_arith(ticket, run, seq)

    def _writable(self, conn: RdmaConnection, keys: TicketKeys) -> None:
        if not keys.writable or not conn.staging[2]:
            raise ReadOnly(f"{self.where}: the region was opened read-only (no staging area)")

    def _do_arith(self, ticket: str, run: Callable[[RdmaConnection, TicketKeys, dict[str, bool]], None],
                  seq: int = 0) -> None:
        """Server errors arrive as replies (typed, QP intact); error completions as
        Broken. A numbered request (``seq``) runs again on a fresh queue pair: the
        server answers its messages that took effect and applies the others. An
        unnumbered one could apply twice, so only failures before its first message
        (a stale extent map) connect again."""
        def guarded(conn: RdmaConnection, keys: TicketKeys) -> None:
            state = {"sent": False}
            try:
                run(conn, keys, state)
            except Broken as exc:
                if state["sent"] and not seq:
                    exc.reconnect = False
                raise
        self._do(ticket, guarded)

    def reductions(self) -> RdmaReduceStream:
        """The collective's ``REDUCE`` stream to this server over RDMA (a queue pair of
        its own, made when first needed; owned by the session)."""
        with self._stream_lock:
            if self._stream is None:
                peer = self.peer
                self._stream = RdmaReduceStream(
                    lambda: RdmaConnection(peer, recv_depth=REDUCE_RECV_DEPTH, remote_write=True),
                    self.shared.remote_cache, f"{self.where} (reduce)")
            return self._stream

    def close(self) -> None:
        """Close the reduce stream and the queue pairs (each says BYE to the server) and
        the gRPC channel."""
        with self._stream_lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        self.pool.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
