"""The Controller gRPC service: messages in, calls out, results and errors back.

Every handler translates a request into a call on :class:`.state.ControllerState`
(membership, lookups), :class:`.creation.RegionCreator` (create and delete, which
reserve and release extents on memory servers) or :class:`.barriers.Barriers`, and
the result into a reply; typed errors become gRPC status codes (``typed_errors``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc

from smb_protocol import errors, tickets
from smb_protocol._proto.smb.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from smb_server.runtime.credentials import ADMIN, CLIENT, SERVER
from smb_server.runtime.grpc_util import current_principal, typed_errors

from .barriers import MAX_WAITERS, Barriers
from .creation import RegionCreator
from .heads import plan_heads
from .memservers import RELEASE_TIMEOUT, RESERVE_TIMEOUT, GrpcMemoryServers
from .moves import plan_rebalance
from .records import CreateRequest, ExtentRecord, FailedReplica, HeldExtent, RegionRecord, ServerRecord
from .stores.protocol import StateStore

if TYPE_CHECKING:
    from .repair import RepairManager

log = logging.getLogger(__name__)

TICKET_MODES = (tickets.TicketMode.RO.value, tickets.TicketMode.RW.value)  # regions open in these

# who may call what (RoleAuth); the first role is the one a refusal names. A server may
# also speak only for itself (checked in the handlers).
METHOD_ROLES: dict[str, tuple[str, ...]] = {
    "RegisterServer": (SERVER,),
    "Heartbeat": (SERVER,),
    "UnregisterServer": (SERVER, ADMIN),
    "DrainServer": (ADMIN,),
    "RemoveServer": (ADMIN,),
    "Rebalance": (ADMIN,),
    "ListServers": (CLIENT, SERVER),
    "CreateRegion": (CLIENT,),
    "OpenRegion": (CLIENT,),
    "DeleteRegion": (CLIENT,),
    "ListRegions": (CLIENT,),
    "RenewLease": (CLIENT,),
    "Barrier": (CLIENT,),
}


def _check_acts_for(server_id: str) -> None:
    """Raise PermissionDenied unless the caller may speak for memory server ``server_id``."""
    principal = current_principal()
    if principal is not None and not principal.acts_for(server_id):
        raise errors.PermissionDenied(
            f"this caller is {principal}; it may not act for server {server_id!r} "
            "(a server credential speaks for its own server id only)")


# -- message conversion -------------------------------------------------------------------
def server_info(s: ServerRecord) -> common_pb2.ServerInfo:
    return common_pb2.ServerInfo(
        server_id=s.server_id, host_id=s.host_id, grpc_address=s.grpc_address,
        endpoints=list(s.endpoints), capacity_bytes=s.capacity, used_bytes=s.used, state=s.state,
        last_heartbeat=s.last_heartbeat, extents=s.extents, evacuating=s.evacuating)


def extent_ref(e: ExtentRecord) -> common_pb2.ExtentRef:
    return common_pb2.ExtentRef(
        extent_id=e.extent_id, server_id=e.server_id, length=e.length,
        grpc_address=e.grpc_address, host_id=e.host_id, endpoints=list(e.endpoints),
        server_state=e.server_state, index=e.index, copy=e.copy, role=e.role, view=e.view)


def region_info(r: RegionRecord) -> common_pb2.RegionInfo:
    """``extents``: each slot's primary in layout order; ``copies``: backups and
    syncing copies (replicated regions; stale copies are not shown)."""
    return common_pb2.RegionInfo(
        name=r.name, uid=r.uid, size=r.size, placement=r.placement, stripe_unit=r.stripe_unit,
        segment_sizes=list(r.segment_sizes), segment_servers=list(r.segment_extents),
        extents=[extent_ref(e) for e in r.primaries()],
        copies=[extent_ref(e) for e in r.others()],
        persistent=r.persistent, created_at=r.created_at, state=r.state, replicas=r.replicas)


def _held(items: Iterable[controller_pb2.HeldExtent]) -> list[HeldExtent]:
    return [HeldExtent(h.extent_id, h.region_uid, h.length, h.age_seconds) for h in items]


# -- the servicer -------------------------------------------------------------------------
class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    """Borrows ``state`` (the caller closes it); owns its memory-server channels, the
    region creator and the barriers, all closed by :meth:`close`.

    ``secret`` signs tickets (shared with the memory servers); ``token`` is the bearer
    token sent to memory servers; ``ticket_ttl`` (seconds) is the life of region tickets.
    :attr:`on_failed_replicas` gets the backups a heartbeat reports as failed (the
    controller hands them to its repair manager).
    """

    def __init__(self, state: StateStore, secret: bytes, token: str = "",
                 ticket_ttl: float = tickets.DEFAULT_TTL,
                 reserve_timeout: float = RESERVE_TIMEOUT,
                 release_timeout: float = RELEASE_TIMEOUT,
                 max_barrier_waits: int = MAX_WAITERS) -> None:
        self.state = state
        self.secret = secret
        self.ticket_ttl = ticket_ttl
        self.memservers = GrpcMemoryServers(secret, token, reserve_timeout, release_timeout)
        self.creator = RegionCreator(state, self.memservers)
        self.barriers = Barriers(max_barrier_waits)
        self.on_failed_replicas: Callable[[list[FailedReplica]], None] | None = None
        #: the controller's repair manager (moves) and what starts a pass now
        self.repairs: RepairManager | None = None
        self.wake_repairs: Callable[[], None] = lambda: None

    def close(self) -> None:
        """Wake barrier waiters, finish memory-server calls, close channels."""
        self.barriers.close()
        self.creator.close()
        self.memservers.close()

    def _response(self, region: RegionRecord, mode: str) -> controller_pb2.RegionResponse:
        # the ticket names every copy: clients read from backups too
        token, expires_at = tickets.sign(self.secret, region.uid, region.extent_ids, mode,
                                         ttl=self.ticket_ttl)
        return controller_pb2.RegionResponse(
            region=region_info(region),
            ticket=common_pb2.Ticket(token=token, expires_at=expires_at, mode=mode))

    # -- membership ----------------------------------------------------------------------
    @typed_errors
    def RegisterServer(self, request: controller_pb2.RegisterServerRequest,
                       context: grpc.ServicerContext) -> Any:
        _check_acts_for(request.server_id)
        server_id, orphans = self.state.register_server(
            request.server_id, request.host_id, request.grpc_address, list(request.endpoints),
            request.capacity_bytes, _held(request.extents))
        return controller_pb2.RegisterServerResponse(
            server_id=server_id, lease_seconds=self.state.lease_seconds, orphan_extent_ids=orphans)

    @typed_errors
    def Heartbeat(self, request: controller_pb2.HeartbeatRequest,
                  context: grpc.ServicerContext) -> Any:
        _check_acts_for(request.server_id)
        orphans = self.state.heartbeat(request.server_id, _held(request.extents))
        if request.failed_replicas and self.on_failed_replicas is not None:
            self.on_failed_replicas([
                FailedReplica(request.server_id, f.primary_extent_id, f.backup_extent_id, f.view, f.reason)
                for f in request.failed_replicas])
        return controller_pb2.HeartbeatResponse(lease_seconds=self.state.lease_seconds,
                                                orphan_extent_ids=orphans)

    @typed_errors
    def UnregisterServer(self, request: controller_pb2.UnregisterServerRequest,
                         context: grpc.ServicerContext) -> Any:
        _check_acts_for(request.server_id)
        server = self.state.unregister(request.server_id, request.reason)
        return controller_pb2.UnregisterServerResponse(server=server_info(server))

    @typed_errors
    def DrainServer(self, request: controller_pb2.DrainServerRequest,
                    context: grpc.ServicerContext) -> Any:
        server = self.state.drain(request.server_id, undrain=request.undrain, evacuate=request.evacuate)
        if request.evacuate:
            self.wake_repairs()
        return controller_pb2.DrainServerResponse(server=server_info(server))

    @typed_errors
    def RemoveServer(self, request: controller_pb2.RemoveServerRequest,
                     context: grpc.ServicerContext) -> Any:
        server = self.state.remove_server(request.server_id)
        return controller_pb2.RemoveServerResponse(server=server_info(server))

    @typed_errors
    def Rebalance(self, request: controller_pb2.RebalanceRequest, context: grpc.ServicerContext) -> Any:
        if self.repairs is None:
            raise errors.ControllerUnavailable("this controller is starting; retry")
        if request.bytes_per_second < 0:
            raise errors.InvalidArgument(f"bytes_per_second must be >= 0, not {request.bytes_per_second}")
        moves = self.repairs.moves
        servers, regions = self.state.list_servers(), self.state.list_regions()
        left = sum(m.length for m in plan_rebalance(servers, regions))
        if request.stop:
            moves.stop()
        elif moves.running() or left or plan_heads(servers, regions, limit=1):   # bytes, or heads only
            moves.start(request.bytes_per_second, self.repairs.clock())   # a new one, or a new rate
            self.wake_repairs()
        return controller_pb2.RebalanceResponse(running=moves.running(), bytes_left=left,
                                                bytes_moved=self.repairs.metrics.moved_bytes)

    @typed_errors
    def ListServers(self, request: controller_pb2.ListServersRequest,
                    context: grpc.ServicerContext) -> Any:
        infos = [server_info(s) for s in self.state.list_servers()]
        evacuations = self.repairs.evacuations if self.repairs is not None else {}
        now = time.time()
        for info in infos:
            if info.server_id in evacuations:   # progress as this leader saw it
                since, held = evacuations[info.server_id]
                info.moved_bytes = max(0, held - info.used_bytes)
                info.move_rate = info.moved_bytes / max(now - since, 1e-3)
        return controller_pb2.ListServersResponse(servers=infos)

    # -- regions -------------------------------------------------------------------------
    @typed_errors
    def CreateRegion(self, request: controller_pb2.CreateRegionRequest,
                     context: grpc.ServicerContext) -> Any:
        create = CreateRequest(request.name, request.size, placement=request.placement,
                               stripe_unit=request.stripe_unit, num_servers=request.num_servers,
                               segment_sizes=tuple(request.segment_sizes), persistent=request.persistent,
                               uid=request.uid, replicas=request.replicas,
                               server_weights=tuple(sorted(request.server_weights.items())),
                               owner=request.owner, lease_seconds=request.lease_seconds)
        return self._response(self.creator.create(create, exist_ok=request.exist_ok), "rw")

    @typed_errors
    def OpenRegion(self, request: controller_pb2.OpenRegionRequest,
                   context: grpc.ServicerContext) -> Any:
        mode = request.mode or "rw"
        if mode not in TICKET_MODES:
            raise errors.InvalidArgument(f"mode must be one of {', '.join(TICKET_MODES)}, got {mode!r}")
        region = self.state.get_region(request.name)
        if region.state == "lost":
            raise errors.RegionLost(f"region {region.name!r} is lost: memory server(s) "
                                    f"{', '.join(region.lost_servers)} came back without its extents; "
                                    f"delete it and create it again")
        return self._response(region, mode)

    @typed_errors
    def DeleteRegion(self, request: controller_pb2.DeleteRegionRequest,
                     context: grpc.ServicerContext) -> Any:
        self.creator.delete(request.name, request.request_id)
        return controller_pb2.DeleteRegionResponse()

    @typed_errors
    def RenewLease(self, request: controller_pb2.RenewLeaseRequest, context: grpc.ServicerContext) -> Any:
        return controller_pb2.RenewLeaseResponse(regions=self.state.renew_lease(request.owner))

    @typed_errors
    def ListRegions(self, request: controller_pb2.ListRegionsRequest,
                    context: grpc.ServicerContext) -> Any:
        return controller_pb2.ListRegionsResponse(
            regions=[region_info(r) for r in self.state.list_regions(request.prefix)])

    # -- coordination --------------------------------------------------------------------
    @typed_errors
    def Barrier(self, request: controller_pb2.BarrierRequest, context: grpc.ServicerContext) -> Any:
        generation, arrival = self.barriers.wait(
            request.name, request.parties, request.timeout_seconds or None, is_active=context.is_active,
            caller=context.peer(), arrival_id=request.arrival_id,
            rank=request.rank if request.HasField("rank") else None)
        return controller_pb2.BarrierResponse(generation=generation, arrival=arrival)
