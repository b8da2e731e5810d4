"""The memory server's gRPC service: a thin translation onto the arena.

``ReserveExtent`` and ``ReleaseExtent`` carry a controller-signed ``admin`` ticket
naming the extent (and refused when its leader epoch is older than one already seen:
a deposed controller's) (the bearer-token check is exempted for them, see
:data:`TICKET_METHODS`); ``Connect`` (RDMA queue-pair exchange) carries a region ticket
(``ro`` or ``rw``), verified here and handed to the rdma plane, and is refused when the
server runs no rdma plane; ``ConfigureReplicas`` (admin ticket naming the extent, as
``ReserveExtent``) sets the extent's place in its replica set (:mod:`.replication`);
``Stats`` needs the bearer token.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from smb_protocol._proto.smb.v1 import memory_server_pb2 as pb
from smb_protocol._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import InvalidArgument, InvalidTicket, PermissionDenied
from smb_protocol.rdma.verbs import QPInfo
from smb_protocol.tickets import Ticket, TicketMode, verify
from smb_server.runtime.grpc_util import typed_errors

from . import replication
from .arena import Arena
from .stats import PlaneStats

if TYPE_CHECKING:
    from .rdma_plane import RdmaPlane

log = logging.getLogger(__name__)

SERVICE = "/smb.v1.MemoryServer/"
#: methods that check a ticket instead of the bearer token
TICKET_METHODS = (SERVICE + "ReserveExtent", SERVICE + "ReleaseExtent", SERVICE + "Connect",
                  SERVICE + "ConfigureReplicas")


def rss_bytes() -> int:
    """Resident set size of this process in bytes (VmRSS of /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemoryServerServicer(pb_grpc.MemoryServerServicer):
    """Borrows ``arena`` and ``stats``; ``server_id``, ``endpoints`` and ``metrics_port``
    are callables so the servicer can be built before the planes and the id are known.
    """

    def __init__(self, arena: Arena, secret: bytes, stats: PlaneStats,
                 server_id: Callable[[], str] = lambda: "",
                 endpoints: Callable[[], Sequence[str]] = lambda: (),
                 rdma: Callable[[], RdmaPlane | None] = lambda: None,
                 metrics_port: Callable[[], int] = lambda: 0) -> None:
        self.arena = arena
        self.secret = secret
        self.stats = stats
        self._server_id = server_id
        self._endpoints = endpoints
        self._rdma = rdma
        self._metrics_port = metrics_port
        self.epoch = 0  # the newest controller leader epoch seen in an admin ticket
        self._epoch_lock = threading.Lock()
        self.replication = replication.for_arena(arena, secret)

    def _admin(self, token: str, extent_id: int) -> Ticket:
        ticket = verify(self.secret, token)
        if ticket.mode != "admin":
            raise PermissionDenied(f"an admin ticket is required, not a {ticket.mode!r} one")
        if extent_id not in ticket.extent_ids:
            raise InvalidTicket(f"the ticket does not name extent {extent_id}")
        with self._epoch_lock:
            if ticket.epoch < self.epoch:
                raise InvalidTicket(f"admin ticket of leader epoch {ticket.epoch}, from a deposed "
                                    f"controller (this server has seen epoch {self.epoch})")
            if ticket.epoch > self.epoch:
                log.info("controller leader epoch %d", ticket.epoch)
                self.epoch = ticket.epoch
        return ticket

    @typed_errors
    def ReserveExtent(self, request: pb.ReserveExtentRequest, context: grpc.ServicerContext) -> Any:
        ticket = self._admin(request.ticket, request.extent_id)
        if ticket.region_uid and ticket.region_uid != request.region_uid:
            raise InvalidTicket(f"the ticket is for region {ticket.region_uid!r}, "
                                f"not {request.region_uid!r}")
        extent = self.arena.reserve(request.extent_id, request.region_uid, request.length,
                                    persistent=request.persistent)
        log.info("reserved extent %d: %d bytes for region %s%s", extent.extent_id, extent.length,
                 extent.region_uid, " (file-backed)" if extent.path else "")
        return pb.ReserveExtentResponse(extent_id=extent.extent_id, length=extent.length)

    @typed_errors
    def ReleaseExtent(self, request: pb.ReleaseExtentRequest, context: grpc.ServicerContext) -> Any:
        self._admin(request.ticket, request.extent_id)
        released = self.arena.release(request.extent_id)
        log.info("release extent %d: %s", request.extent_id, "done" if released else "was not held")
        return pb.ReleaseExtentResponse(released=released)

    @typed_errors
    def ConfigureReplicas(self, request: pb.ConfigureReplicasRequest, context: grpc.ServicerContext) -> Any:
        ticket = self._admin(request.ticket, request.extent_id)
        extent = self.arena.get(request.extent_id)
        if ticket.region_uid and ticket.region_uid != extent.region_uid:
            raise InvalidTicket(f"the ticket is for region {ticket.region_uid!r}, "
                                f"not {extent.region_uid!r}")
        targets = [(b.extent_id, b.server_id, _tcp_endpoint(b.endpoints, b.server_id), b.sync)
                   for b in request.backups]
        view, synced = self.replication.configure(extent, request.view, request.role, targets)
        return pb.ConfigureReplicasResponse(view=view, synced_bytes=synced)

    @typed_errors
    def Connect(self, request: pb.ConnectRequest, context: grpc.ServicerContext) -> Any:
        plane = self._rdma()
        if plane is None:
            raise InvalidArgument("rdma transport is not enabled on this server "
                                  "(no RDMA device, or 'rdma' not in its transports)")
        ticket = verify(self.secret, request.ticket)
        if ticket.mode is TicketMode.ADMIN:
            raise PermissionDenied("Connect needs a region ticket (ro or rw), not an admin one")
        peer = QPInfo(request.qpn, request.psn, bytes(request.gid), request.mtu, request.lid)
        answer = plane.connect(ticket, peer, context.peer())
        extents = [pb.RemoteExtent(extent_id=e, address=a, rkey=k, length=n)
                   for e, a, k, n in answer.pop("extents")]
        return pb.ConnectResponse(extents=extents, **answer)

    @typed_errors
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> Any:
        counts = self.stats.snapshot()
        return pb.StatsResponse(
            server_id=self._server_id(), capacity_bytes=self.arena.capacity,
            used_bytes=self.arena.used, extents=len(self.arena),
            bytes_read=counts["bytes_read"], bytes_written=counts["bytes_written"],
            bytes_accumulated=counts["bytes_accumulated"], operations=counts["operations"],
            errors=counts["errors"], sessions=max(0, counts["sessions"]), rss_bytes=rss_bytes(),
            endpoints=list(self._endpoints()), metrics_port=self._metrics_port())


def _tcp_endpoint(endpoints: Sequence[str], server_id: str) -> str:
    """The tcp (or tcp+tls) data-plane endpoint among a backup server's endpoints."""
    for uri in endpoints:
        if parse_endpoint(uri).scheme.startswith("tcp"):
            return uri
    raise InvalidArgument(f"backup server {server_id or '?'} offers no tcp endpoint "
                          f"(it has {', '.join(endpoints) or 'none'}): replicas forward over tcp")
