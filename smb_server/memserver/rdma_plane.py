"""The RDMA data plane of a memory server (pyverbs, RC queue pairs).

Memory: every extent's data is registered twice when the arena creates it (this plane
is an arena listener): an ``rw`` registration (LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE
| REMOTE_ATOMIC) and an ``ro`` one (REMOTE_READ only). When an extent is released, the
queue pairs of every connection that may reach it are moved to ERROR and both
registrations are deregistered *before* the arena punches out and unmaps its pages, so
old rkeys stop working and can never reach memory handed to someone else later.

Connections (:class:`~.rdma_connection.ServerConnection`): :meth:`RdmaPlane.connect`
serves the ``Connect`` gRPC call, which presents one verified ticket for the client's
queue pair named by its :class:`~smb_protocol.rdma.verbs.QPInfo`. The first ``Connect`` of a
queue pair (QPN, PSN, GID) creates the server's side; a later one adds its ticket to
that connection. The answer holds the server QP's QPN/PSN/GID, the negotiated MTU and,
for each extent of the ticket's region held here, the address and the rkey of the
registration matching the ticket's mode (the ``ro`` one for an extent of a replicated
region, whose mutations go to its primary's tcp plane), plus the staging area for a
writing ticket; two-sided arithmetic on a replicated extent is refused with NotPrimary.
A ``Connect`` naming a queue pair this plane already dropped is refused
(``ServerUnavailable``): the client must connect a new one.

One-sided READ/WRITE and atomics never involve this process's CPU. Server-side
arithmetic is two-sided (:mod:`smb_protocol.rdma_wire`): the progress thread checks each
request against the ticket presented for its extent and computes with :mod:`.kernels`
under the extent's lock.

Threads: one progress thread polls every connection's completion queue with back-off
(pyverbs calls keep the GIL, so nothing blocks in verbs) and alone destroys
connections; other threads only mark them doomed. Connections end on the client's BYE,
on an error completion, when the ticket in force for one of their extents expires,
or when an extent they reach is released. In the last two cases the server first SENDs
an unsolicited *notice* (a reply with ``req_id`` 0 and the error's status) so the
client fails at once with a typed error instead of waiting for transport retries.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from smb_protocol.errors import (
    ExtentNotFound,
    InvalidArgument,
    NotPrimary,
    OutOfMemory,
    ServerUnavailable,
    TicketExpired,
)
from smb_protocol.rdma import verbs
from smb_protocol.tickets import Ticket, TicketMode

from .arena import Extent
from .engine import Engine
from .node import Node
from .rdma_connection import ServerConnection
from .stats import PlaneStats

log = logging.getLogger(__name__)

STAGING_BYTES = 4 << 20   # bytes of operand staging per connection with a writing ticket
SPIN_POLLS = 64           # empty polls before the progress thread starts to nap
NAP_FIRST = 20e-6         # seconds, first nap when idle
NAP_MAX = 2e-3            # seconds, longest nap when idle
REAP_INTERVAL = 1.0       # seconds between checks for expired tickets
DROPPED_MEMORY = 4096     # queue pairs remembered as dropped (a late Connect for one is refused)


def access_flags() -> tuple[int, int, int]:
    """(rw registration, ro registration, staging) access flags."""
    import pyverbs.enums as e
    rw = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
          | e.IBV_ACCESS_REMOTE_ATOMIC)
    return rw, e.IBV_ACCESS_REMOTE_READ, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE


@dataclass
class _Registration:
    """The two registrations of one extent (owned by the plane)."""

    extent: Extent
    address: int
    rw: Any
    ro: Any

    def close(self) -> None:
        for mr in (self.rw, self.ro) if self.rw is not self.ro else (self.ro,):
            try:
                mr.close()
            except Exception as exc:
                log.warning("extent %d: deregistration failed: %s", self.extent.extent_id, exc)


class RdmaPlane:
    """The memory server's verbs resources: device, extent registrations, connections.

    Borrows ``node`` (registers itself as a listener of its arena; :meth:`close`
    removes it) and ``stats``; two-sided requests are served by an
    :class:`~.engine.Engine` over the node. Owns the device and everything created on it. ``device``: the RDMA
    device name (default ``$SMB_RDMA_DEVICE`` or the first active one);
    ``prefer_ipv4``: use the GID of this address when the device has one.
    """

    def __init__(self, node: Node, stats: PlaneStats | None = None, device: str | None = None,
                 prefer_ipv4: str | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        self.node = node
        self.arena = arena = node.arena
        self.engine = Engine(node)
        self.stats = stats if stats is not None else PlaneStats("rdma")
        self.device = verbs.Device(device, prefer_ipv4=prefer_ipv4)
        self.rw_access, self.ro_access, self.staging_access = access_flags()
        self.staging_bytes = staging_bytes
        self.closing = False
        self._lock = threading.Lock()
        self._regs: dict[int, _Registration] = {}
        self._conns: list[ServerConnection] = []
        self._connected = threading.Event()   # set when a connection is added, and on close
        self._by_peer: dict[tuple[bytes, int, int], ServerConnection] = {}
        self._dropped: collections.OrderedDict[tuple[bytes, int, int], None] = collections.OrderedDict()
        try:
            arena.add_listener(self)
            node.replication.revoke_direct.append(self.revoke_writes)
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

    def revoke_writes(self, extent: Extent) -> None:
        """The extent stops taking one-sided writes (it is being moved, or became a
        replicated copy): its writable registration is replaced (once deregistered, no
        queue pair can write or run atomics through the old rkey), and every connection
        that reaches it is told NotPrimary and closed, so that its client opens the
        region again and sends mutations to the extent's tcp plane. A new Connect gets
        the read-only rkey while the extent has a role."""
        with self._lock:
            reg = self._regs.get(extent.extent_id)
            if reg is None or reg.extent is not extent:
                return
            conns = [c for c in self._conns if extent.extent_id in c.extent_ids]
            old = reg.rw
            try:
                reg.rw = self.device.create_mr(reg.address, extent.length, self.rw_access)
            except Exception as exc:   # read-only until the arena re-registers it
                log.warning("extent %d: cannot register it again for writes: %s", extent.extent_id, exc)
                reg.rw = reg.ro
        notice = NotPrimary(f"extent {extent.extent_id} is being moved or replicated: its mutations go "
                            "to its primary's tcp data plane; open the region again")
        for conn in conns:
            conn.doom(f"extent {extent.extent_id} stopped taking rdma writes", notice)
        if old is not reg.ro:
            try:
                old.close()
            except Exception as exc:
                log.warning("extent %d: deregistration failed: %s", extent.extent_id, exc)
        log.info("extent %d: rdma write access revoked (%d connection(s) closed)", extent.extent_id, len(conns))

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

    def local_key(self, extent_id: int, address: int, length: int) -> int | None:
        """The lkey of extent ``extent_id``'s registration when it covers ``[address,
        address + length)`` (a sum sent from the extent's memory); else None."""
        with self._lock:
            reg = self._regs.get(extent_id)
        if reg is None or not reg.address <= address <= address + length <= reg.address + reg.extent.length:
            return None
        return int(reg.rw.lkey)

    # -- Connect ------------------------------------------------------------------------
    def connect(self, ticket: Ticket, peer: verbs.QPInfo, peer_name: str = "") -> dict[str, Any]:
        """Present ``ticket`` for the client queue pair ``peer``: set up the server's side
        on the first call for that queue pair, add the ticket on later ones. Returns the
        fields of a ``ConnectResponse`` (``extents`` as (extent_id, address, rkey, length)
        tuples; staging only for a writing ticket).

        Raises ExtentNotFound when no extent of the ticket's region is held here,
        ServerUnavailable when the queue pair was already dropped.
        """
        if self.closing:
            raise ExtentNotFound("the rdma plane is closing")
        if len(peer.gid) != 16:
            raise InvalidArgument(f"Connect: a GID is 16 bytes, got {len(peer.gid)}")
        mode = TicketMode(ticket.mode)
        if mode not in (TicketMode.RO, TicketMode.RW):
            raise InvalidArgument(f"Connect needs an ro or rw ticket, not {mode.value!r}")
        key = (bytes(peer.gid), peer.qpn, peer.psn)
        with self._lock:
            regs = [self._regs[e] for e in sorted(ticket.extent_ids)
                    if e in self._regs and self._regs[e].extent.region_uid == ticket.region_uid
                    and self._regs[e].extent.live]
            conn = self._by_peer.get(key)
            dropped = key in self._dropped or (conn is not None and bool(conn.doomed))
        if dropped:
            raise ServerUnavailable(f"queue pair {peer.qpn} was closed by the server; connect a new one")
        if not regs:
            raise ExtentNotFound(f"no extent of region {ticket.region_uid!r} on this server "
                                 "(the region was deleted?)")
        new = conn is None
        if conn is None:
            conn = ServerConnection(self.node, self.engine, self.device, self.stats, self.staging_bytes,
                                    self.staging_access, peer, peer_name, self.local_key)
        try:
            staging = conn.ensure_staging() if mode.writes else None
        except Exception as exc:
            if new:
                conn.close()
            raise OutOfMemory(f"cannot register a staging area: {exc} (check `ulimit -l`)") from None
        ids = frozenset(r.extent.extent_id for r in regs)
        with self._lock:
            if self.closing or (not new and conn not in self._conns):
                if new:
                    conn.close()
                raise ServerUnavailable(f"queue pair {peer.qpn}: the connection is closing")
            # a release between the lookup and now must cut this connection too
            gone = [r for r in regs if self._regs.get(r.extent.extent_id) is not r]
            conn.add_ticket(ticket, ids)
            if new:
                self._conns.append(conn)
                self._by_peer[key] = conn
                self._connected.set()
        if gone:
            conn.doom("extent released during Connect")
            raise ExtentNotFound(f"extent {gone[0].extent.extent_id} was released during Connect")
        if new:
            self.stats.add(sessions=1)
        def rkey(r: _Registration) -> int:
            writes = mode.writes and not self.node.replication.role(r.extent.extent_id)
            return int((r.rw if writes else r.ro).rkey)

        extents = [(r.extent.extent_id, r.address, rkey(r), r.extent.length) for r in regs]
        log.debug("rdma connect %s: qpn %d <-> %d, %s ticket (%s), mtu %d, %d extents", peer_name,
                  conn.info.qpn, peer.qpn, mode.value, "new" if new else "added", conn.mtu, len(extents))
        return {"qpn": conn.info.qpn, "psn": conn.psn, "gid": conn.info.gid, "mtu": conn.mtu, "lid": 0,
                "extents": extents,
                "staging_address": staging.address if staging else 0,
                "staging_rkey": staging.rkey if staging else 0,
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
            if not conns:
                # nothing to poll: sleep until a connection is added (or the plane closes),
                # rather than waking every NAP_MAX while no client is connected
                self._connected.wait()
                self._connected.clear()
                idle, nap = 0, NAP_FIRST
                continue
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
                    if not conn.doomed and conn.expired(wall):
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

    def _drop(self, conn: ServerConnection) -> None:
        with self._lock:
            if conn not in self._conns:
                return
            self._conns.remove(conn)
            if self._by_peer.get(conn.peer_key) is conn:
                del self._by_peer[conn.peer_key]
            self._dropped[conn.peer_key] = None
            while len(self._dropped) > DROPPED_MEMORY:
                self._dropped.popitem(last=False)
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
            self._by_peer = {}
            regs, self._regs = list(self._regs.values()), {}
        for conn in conns:          # children first: QPs and their buffers, CQs ...
            conn.doom("server closing")
            conn.ep.set_error()
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
        self._connected.set()
        self.arena.remove_listener(self)
        with contextlib.suppress(ValueError):
            self.node.replication.revoke_direct.remove(self.revoke_writes)
        self._thread.join(timeout)
        self._release_all()
        log.info("rdma data plane on %s closed", self.device.name)

    def __enter__(self) -> RdmaPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
