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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from smb_protocol._proto.smb.v1 import memory_server_pb2 as pb
from smb_protocol._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import InvalidArgument, InvalidTicket, PermissionDenied
from smb_protocol.rdma.verbs import QPInfo
from smb_protocol.tickets import Ticket, TicketMode, verify
from smb_server.runtime.grpc_util import typed_errors

from .node import Node

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


class Served(Protocol):
    """What the servicer reports about the server it serves for (the memory server
    daemon), read at each call: its id, data-plane endpoints, rdma plane (for
    ``Connect``) and metrics port. Known only once the planes are up."""

    server_id: str
    endpoints: list[str]

    @property
    def rdma(self) -> RdmaPlane | None: ...

    @property
    def metrics_port(self) -> int: ...


@dataclass
class ServerInfo:
    """A :class:`Served` of fixed values (a servicer without a daemon around it)."""

    server_id: str = ""
    endpoints: list[str] = field(default_factory=list)
    rdma: RdmaPlane | None = None
    metrics_port: int = 0


class MemoryServerServicer(pb_grpc.MemoryServerServicer):
    """Borrows ``node`` (arena, secret, statistics, replication) and ``server`` (what
    the server reports about itself, see :class:`Served`)."""

    def __init__(self, node: Node, server: Served | None = None) -> None:
        self.node = node
        self.arena = node.arena
        self.secret = node.secret
        self.stats = node.stats
        self.server: Served = server if server is not None else ServerInfo()
        self.epoch = 0  # the newest controller leader epoch seen in an admin ticket
        self._epoch_lock = threading.Lock()
        self.replication = node.replication

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
        plane = self.server.rdma
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
            server_id=self.server.server_id, capacity_bytes=self.arena.capacity,
            used_bytes=self.arena.used, extents=len(self.arena),
            bytes_read=counts["bytes_read"], bytes_written=counts["bytes_written"],
            bytes_accumulated=counts["bytes_accumulated"], operations=counts["operations"],
            errors=counts["errors"], sessions=max(0, counts["sessions"]), rss_bytes=rss_bytes(),
            endpoints=list(self.server.endpoints), metrics_port=self.server.metrics_port)


def _tcp_endpoint(endpoints: Sequence[str], server_id: str) -> str:
    """The tcp (or tcp+tls) data-plane endpoint among a backup server's endpoints."""
    for uri in endpoints:
        if parse_endpoint(uri).scheme.startswith("tcp"):
            return uri
    raise InvalidArgument(f"backup server {server_id or '?'} offers no tcp endpoint "
                          f"(it has {', '.join(endpoints) or 'none'}): replicas forward over tcp")
