"""Verbs plumbing shared by the rdma transport, the memory server's rdma plane and
``smb doctor``: device discovery, GID selection, and RC queue-pair setup.

Layered like rdma-core's pyverbs tests: a :class:`Device` opens the context and the
protection domain; small ``create_*`` steps build completion queues, memory
registrations and queue pairs on it; :func:`connect_qp` walks a queue pair through
INIT -> RTR -> RTS once the peers swapped a :class:`QPInfo` (QPN, PSN, GID, MTU, LID)
out of band (here: the memory server's ``Connect`` gRPC call).

Only :func:`device_names` and :func:`has_device` work without pyverbs; everything else
imports it lazily, so ``import smb_protocol.rdma.verbs`` never fails on a host without
rdma-core. Ownership: a :class:`Device` owns its context and PD and closes them last;
whoever creates a CQ, MR or QP closes it before the device (parents close children
first).
"""
from __future__ import annotations

import functools
import importlib.util
import ipaddress
import logging
import os
import random
import threading
from dataclasses import dataclass
from typing import Any

from smb_protocol.errors import InvalidArgument, SMBError

log = logging.getLogger(__name__)

SYSFS_DEVICES = "/sys/class/infiniband"
PORT_NUM = 1              # the (only) port of RoCE devices
TIMEOUT = 14              # local ACK timeout exponent: 4.096 us * 2**14 = 67 ms per try
RETRY_CNT = 7             # transport retries before IBV_WC_RETRY_EXC_ERR
RNR_RETRY = 7             # 7 = retry forever on receiver-not-ready
MIN_RNR_TIMER = 12        # 0.64 ms before a receiver-not-ready retry
MAX_RD_ATOMIC = 16        # RDMA READs/atomics in flight per QP (capped by the device)
PSN_MASK = 0xFFFFFF       # packet sequence numbers are 24 bits

#: ibv_mtu enum value <-> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
MTU_ENUM = {b: v for v, b in MTU_BYTES.items()}

ENV_DEVICE = "SMB_RDMA_DEVICE"        # device name to use (default: first with an active port)
ENV_GID_INDEX = "SMB_RDMA_GID_INDEX"  # GID index to use (default: the RoCEv2 IPv4-mapped one)


class VerbsUnavailable(SMBError):
    """No usable RDMA device (or no pyverbs) on this host."""


# -- discovery without pyverbs ------------------------------------------------------
def device_names() -> list[str]:
    """Names of the RDMA devices the kernel knows (``/sys/class/infiniband``)."""
    try:
        return sorted(os.listdir(SYSFS_DEVICES))
    except OSError:
        return []


def pyverbs_available() -> bool:
    """True when pyverbs (the distribution's ``python3-pyverbs``) can be imported."""
    try:
        return importlib.util.find_spec("pyverbs") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def has_device() -> bool:
    """An RDMA device exists and pyverbs imports (a directory listing and an import
    lookup; not cached, since a device may appear later).

    Used by the client's automatic transport choice, which caches what it chose; it does
    not open the device.
    """
    return bool(device_names()) and pyverbs_available()


# -- GIDs ---------------------------------------------------------------------------
def gid_bytes(gid_text: str) -> bytes:
    """16 bytes of a GID written as pyverbs does (``0000:...:7f00:0001``)."""
    return ipaddress.IPv6Address(gid_text).packed


def gid_text(raw: bytes) -> str:
    """The pyverbs text form (eight groups of four hex digits) of a 16-byte GID."""
    if len(raw) != 16:
        raise InvalidArgument(f"a GID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def ipv4_of_gid(raw: bytes) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
    mapped = ipaddress.IPv6Address(raw).ipv4_mapped
    return str(mapped) if mapped is not None else None


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: bytes          # 16 bytes
    roce_v2: bool

    @property
    def ipv4(self) -> str | None:
        return ipv4_of_gid(self.gid)


def gid_table(ctx: Any, port: int = PORT_NUM, length: int | None = None) -> list[GidEntry]:
    """The non-zero GIDs of ``port`` (stops at the first empty slot, as the kernel fills
    the table densely)."""
    import pyverbs.enums as e
    if length is None:
        length = ctx.query_port(port).gid_tbl_len
    out = []
    for i in range(length):
        try:
            raw = gid_bytes(ctx.query_gid(port, i).gid)
        except Exception:  # an unused slot may fail to query
            break
        if raw == bytes(16):
            break
        try:
            v2 = ctx.query_gid_type(port, i) == e.IBV_GID_TYPE_SYSFS_ROCE_V2
        except Exception:
            v2 = False
        out.append(GidEntry(i, raw, v2))
    return out


def choose_gid(entries: list[GidEntry], prefer_ipv4: str | None = None) -> GidEntry:
    """The GID to use: RoCEv2 and IPv4-mapped (as perftest picks), the one of
    ``prefer_ipv4`` when present; else any RoCEv2 one; else the first."""
    if not entries:
        raise VerbsUnavailable("the port's GID table is empty: give the netdev an IP address")
    mapped = [g for g in entries if g.roce_v2 and g.ipv4 is not None]
    for g in mapped:
        if prefer_ipv4 and g.ipv4 == prefer_ipv4:
            return g
    if mapped:
        return mapped[0]
    v2 = [g for g in entries if g.roce_v2]
    return (v2 or entries)[0]


# -- queue-pair exchange ------------------------------------------------------------
@dataclass(frozen=True)
class QPInfo:
    """What a peer needs to reach a queue pair (swapped through ``Connect``)."""

    qpn: int
    psn: int
    gid: bytes          # 16 bytes
    mtu: int            # bytes (256..4096)
    lid: int = 0


def random_psn() -> int:
    return random.getrandbits(24) & PSN_MASK


def negotiate_mtu(a: int, b: int) -> int:
    """The path MTU both ends support, in bytes (the smaller one)."""
    mtu = min(a, b)
    if mtu not in MTU_ENUM:
        raise InvalidArgument(f"unsupported path MTU {mtu} bytes (expected one of {sorted(MTU_ENUM)})")
    return mtu


# -- the device ---------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    name: str
    port_state: int           # ibv_port_state (4 = ACTIVE)
    active_mtu: int           # bytes
    max_msg: int              # bytes in one message
    max_qp_wr: int
    max_rd_atomic: int        # the device's max_qp_rd_atom
    atomic_caps: int          # ibv_atomic_cap (0 = none)
    gid: GidEntry

    @property
    def active(self) -> bool:
        return self.port_state == 4


class Device:
    """An open RDMA device: context and protection domain (owned, closed last).

    ``name``: the device (default ``$SMB_RDMA_DEVICE`` or the first device whose port
    is active). ``prefer_ipv4``: pick the GID of this address when the device has it.
    """

    def __init__(self, name: str | None = None, prefer_ipv4: str | None = None) -> None:
        try:
            import pyverbs.device as d
            from pyverbs.pd import PD
        except ImportError as exc:
            raise VerbsUnavailable(f"pyverbs is not importable ({exc}); install python3-pyverbs "
                                   "and build the venv with --system-site-packages") from None
        name = name or os.environ.get(ENV_DEVICE) or None
        names = device_names() if name is None else [name]
        if not names:
            raise VerbsUnavailable("no RDMA device (/sys/class/infiniband is empty)")
        last: Exception | None = None
        self.ctx: Any = None
        for candidate in names:
            try:
                ctx = d.Context(name=candidate)
            except Exception as exc:
                last = exc
                continue
            if name is None and ctx.query_port(PORT_NUM).state != 4 and candidate != names[-1]:
                ctx.close()
                continue
            self.ctx = ctx
            self.name = candidate
            break
        if self.ctx is None:
            raise VerbsUnavailable(f"cannot open RDMA device {names}: {last}")
        try:
            self.pd = PD(self.ctx)
            self.info = self._query(prefer_ipv4)
        except BaseException:
            self.ctx.close()
            raise
        self._lock = threading.Lock()
        self.closed = False
        log.debug("opened %s: GID index %d (%s), MTU %d", self.name, self.info.gid.index,
                  self.info.gid.ipv4 or gid_text(self.info.gid.gid), self.info.active_mtu)

    def _query(self, prefer_ipv4: str | None) -> DeviceInfo:
        da = self.ctx.query_device()
        pa = self.ctx.query_port(PORT_NUM)
        entries = gid_table(self.ctx, PORT_NUM, pa.gid_tbl_len)
        forced = os.environ.get(ENV_GID_INDEX)
        if forced:
            picked = [g for g in entries if g.index == int(forced)]
            if not picked:
                raise VerbsUnavailable(f"{ENV_GID_INDEX}={forced}: no such GID on {self.name}")
            gid = picked[0]
        else:
            gid = choose_gid(entries, prefer_ipv4)
        return DeviceInfo(self.name, pa.state, MTU_BYTES.get(pa.active_mtu, 1024), pa.max_msg_sz,
                          da.max_qp_wr, da.max_qp_rd_atom, da.atomic_caps, gid)

    # -- children ---------------------------------------------------------------------
    def create_cq(self, depth: int) -> Any:
        """A completion queue of ``depth`` entries (caller closes it before the device)."""
        from pyverbs.cq import CQ
        return CQ(self.ctx, depth)

    def create_mr(self, address: int, length: int, access: int) -> Any:
        """Register ``length`` bytes at ``address`` (zero copy; the caller keeps the
        memory alive and closes the MR before freeing it)."""
        from pyverbs.mr import MR
        return MR(self.pd, length, access, address=address)

    def create_qp(self, cq: Any, max_send_wr: int, max_recv_wr: int, max_send_sge: int = 1) -> Any:
        """An RC queue pair (extended API, ``QPEx``) in RESET on ``cq`` for both queues,
        no implicit signalling."""
        import pyverbs.enums as e
        from pyverbs.qp import QPCap, QPEx, QPInitAttrEx
        ops = (e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_READ | e.IBV_QP_EX_WITH_SEND
               | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | e.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP)
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=max_send_sge,
                    max_recv_sge=1)
        attr = QPInitAttrEx(cap=cap, qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, pd=self.pd,
                            send_ops_flags=ops, sq_sig_all=0,
                            comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
        return QPEx(self.ctx, attr)

    def local_info(self, qp: Any, psn: int) -> QPInfo:
        return QPInfo(qp.qp_num, psn, self.info.gid.gid, self.info.active_mtu, 0)

    def rd_atomic(self) -> int:
        """RDMA READs/atomics in flight per QP: :data:`MAX_RD_ATOMIC` capped by the device."""
        return max(1, min(MAX_RD_ATOMIC, self.info.max_rd_atomic))

    def close(self) -> None:
        """Close the PD and the context (children must be closed already)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.pd.close()
        self.ctx.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_qp(device: Device, qp: Any, local_psn: int, remote: QPInfo, mtu: int,
               access: int, rd_atomic: int) -> None:
    """Move an RC ``qp`` from RESET through INIT and RTR to RTS towards ``remote``.

    ``mtu``: the negotiated path MTU in bytes; ``access``: remote rights the peer gets
    on this QP (``IBV_ACCESS_*``); ``rd_atomic``: READs/atomics in flight both ways.
    """
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=PORT_NUM)
    attr.pkey_index = 0
    attr.qp_access_flags = access
    qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

    gr = GlobalRoute(dgid=GID(gid_text(remote.gid)), sgid_index=device.info.gid.index)
    gr.hop_limit = 64
    ah = AHAttr(port_num=PORT_NUM, is_global=1, gr=gr, dlid=remote.lid)
    attr = QPAttr(qp_state=e.IBV_QPS_RTR)
    attr.path_mtu = MTU_ENUM[mtu]
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = rd_atomic
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.ah_attr = ah
    qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
              | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)

    attr = QPAttr(qp_state=e.IBV_QPS_RTS)
    attr.sq_psn = local_psn
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    attr.max_rd_atomic = rd_atomic
    qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_SQ_PSN | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
              | e.IBV_QP_RNR_RETRY | e.IBV_QP_MAX_QP_RD_ATOMIC)


def set_error(qp: Any) -> None:
    """Move ``qp`` to ERROR: outstanding work flushes, the peer gets no more service."""
    import pyverbs.enums as e
    from pyverbs.qp import QPAttr
    try:
        qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    except Exception as exc:  # already destroyed or in error
        log.debug("cannot move QP to ERROR: %s", exc)


def wc_status_name(status: int) -> str:
    """``IBV_WC_...`` name of a completion status."""
    import pyverbs.enums as e
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") or name in ("IBV_WC_SUCCESS",):
            if getattr(e, name) == status and not name.startswith("IBV_WC_EX"):
                return name
    return f"status {status}"
