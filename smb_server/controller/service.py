"""The Controller gRPC service: messages in, calls on :class:`ControllerState` out.

Besides translating messages, the servicer talks to memory servers: CreateRegion
reserves the planned extents on every chosen server (in parallel, with a short-lived
``admin`` ticket), DeleteRegion releases them. Barriers are kept in memory
(:class:`Barriers`); they do not survive a controller restart, and callers retry on
``Unavailable``.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc

from smb_client import errors, rpc, tickets
from smb_client._proto.smb.v1 import (common_pb2, controller_pb2, controller_pb2_grpc,
                                      memory_server_pb2, memory_server_pb2_grpc)

from ..grpc_util import typed_errors
from .state import ControllerState, ExtentPlace, HeldExtent, RegionRecord, ServerRecord

log = logging.getLogger(__name__)

RESERVE_TIMEOUT = 10.0       # seconds for one ReserveExtent call
RELEASE_TIMEOUT = 5.0        # seconds for one ReleaseExtent call
ADMIN_TICKET_TTL = 60.0      # seconds an admin ticket for one reserve/release lives
EXIST_OK_WAIT = 30.0         # seconds CreateRegion(exist_ok) waits for a concurrent create
EXIST_OK_POLL = 0.05         # seconds between looks at a region being created
BARRIER_POLL = 0.5           # seconds between checks that a barrier caller is still there
MAX_NAME_LENGTH = 255
MEMSERVER_CALL_THREADS = 32  # parallel reserve/release calls, all regions together
TICKET_MODES = ("ro", "rw")


# -- barriers -----------------------------------------------------------------------------
@dataclass
class _Waiter:
    generation: int = -1
    arrival: int = -1
    done: bool = False


@dataclass
class _Barrier:
    parties: int = 0
    generation: int = 0  # times this barrier has opened
    waiters: list[_Waiter] | None = None


class Barriers:
    """Named, reusable, in-memory barriers (pure; no gRPC).

    A barrier opens when ``parties`` callers of the current generation have arrived;
    each gets the generation (how many times the barrier opened before) and its
    0-based order of arrival. A caller that times out, goes away, or is woken by
    :meth:`close` is removed and does not count.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._barriers: dict[str, _Barrier] = {}
        self._closed = False

    def wait(self, name: str, parties: int, timeout: float | None = None,
             is_active: Callable[[], bool] = lambda: True) -> tuple[int, int]:
        """Block until the barrier opens; returns ``(generation, arrival)``.

        ``timeout`` in seconds (None or <= 0: forever). Raises InvalidArgument (no name,
        ``parties`` 0, or a ``parties`` other than the waiting callers'), BarrierTimeout,
        or ControllerUnavailable when the controller closes or ``is_active`` turns false.
        """
        if not name or len(name) > MAX_NAME_LENGTH:
            raise errors.InvalidArgument(f"barrier name must be 1 to {MAX_NAME_LENGTH} characters")
        if parties <= 0:
            raise errors.InvalidArgument("a barrier needs at least one party")
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        with self._cond:
            if self._closed:
                raise errors.ControllerUnavailable("the controller is shutting down")
            barrier = self._barriers.setdefault(name, _Barrier(waiters=[]))
            assert barrier.waiters is not None
            if barrier.waiters and barrier.parties != parties:
                raise errors.InvalidArgument(
                    f"barrier {name!r} is waiting for {barrier.parties} parties "
                    f"({len(barrier.waiters)} arrived); this caller says {parties}")
            barrier.parties = parties
            me = _Waiter()
            barrier.waiters.append(me)
            if len(barrier.waiters) >= parties:
                self._open(barrier)
            while not me.done:
                problem: errors.SMBError | None = None
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed:
                    problem = errors.ControllerUnavailable("the controller is shutting down")
                elif remaining is not None and remaining <= 0:
                    problem = errors.BarrierTimeout(
                        f"barrier {name!r}: {len(barrier.waiters)} of {parties} parties arrived "
                        f"within {timeout:g} s")
                elif not is_active():
                    problem = errors.ControllerUnavailable("the caller went away")
                if problem is not None:
                    barrier.waiters.remove(me)
                    raise problem
                self._cond.wait(BARRIER_POLL if remaining is None else min(remaining, BARRIER_POLL))
            return me.generation, me.arrival

    def _open(self, barrier: _Barrier) -> None:
        assert barrier.waiters is not None
        for arrival, waiter in enumerate(barrier.waiters):
            waiter.generation, waiter.arrival, waiter.done = barrier.generation, arrival, True
        barrier.generation += 1
        barrier.waiters = []
        self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with ControllerUnavailable; later calls fail the same way."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# -- message conversion -------------------------------------------------------------------
def server_info(s: ServerRecord) -> common_pb2.ServerInfo:
    return common_pb2.ServerInfo(
        server_id=s.server_id, host_id=s.host_id, grpc_address=s.grpc_address,
        endpoints=list(s.endpoints), capacity_bytes=s.capacity, used_bytes=s.used, state=s.state,
        last_heartbeat=s.last_heartbeat, extents=s.extents)


def region_info(r: RegionRecord) -> common_pb2.RegionInfo:
    return common_pb2.RegionInfo(
        name=r.name, uid=r.uid, size=r.size, placement=r.placement, stripe_unit=r.stripe_unit,
        segment_sizes=list(r.segment_sizes), segment_servers=list(r.segment_extents),
        extents=[common_pb2.ExtentRef(
            extent_id=e.extent_id, server_id=e.server_id, length=e.length,
            grpc_address=e.grpc_address, host_id=e.host_id, endpoints=list(e.endpoints),
            server_state=e.server_state) for e in r.extents],
        persistent=r.persistent, created_at=r.created_at, state=r.state)


def _held(items: Iterable[controller_pb2.HeldExtent]) -> list[HeldExtent]:
    return [HeldExtent(h.extent_id, h.region_uid, h.length, h.age_seconds) for h in items]


# -- the servicer -------------------------------------------------------------------------
class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    """Borrows ``state`` (the caller closes it); owns its channels to memory servers,
    its thread pool and its barriers, all closed by :meth:`close`.

    ``secret`` signs tickets (shared with the memory servers); ``token`` is the bearer
    token sent to memory servers; ``ticket_ttl`` (seconds) is the life of region tickets.
    """

    def __init__(self, state: ControllerState, secret: bytes, token: str = "",
                 ticket_ttl: float = tickets.DEFAULT_TTL,
                 reserve_timeout: float = RESERVE_TIMEOUT,
                 release_timeout: float = RELEASE_TIMEOUT) -> None:
        self.state = state
        self.secret = secret
        self.token = token
        self.ticket_ttl = ticket_ttl
        self.reserve_timeout = reserve_timeout
        self.release_timeout = release_timeout
        self.barriers = Barriers()
        self._pool = futures.ThreadPoolExecutor(MEMSERVER_CALL_THREADS, thread_name_prefix="memserver-call")
        self._stubs: dict[str, tuple[grpc.Channel, memory_server_pb2_grpc.MemoryServerStub]] = {}
        self._stubs_lock = threading.Lock()

    def close(self) -> None:
        """Wake barrier waiters, finish memory-server calls, close channels."""
        self.barriers.close()
        self._pool.shutdown(wait=True)
        with self._stubs_lock:
            stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            channel.close()

    # -- memory servers ------------------------------------------------------------------
    def _stub(self, address: str) -> memory_server_pb2_grpc.MemoryServerStub:
        with self._stubs_lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = rpc.channel(address)
                entry = (channel, memory_server_pb2_grpc.MemoryServerStub(channel))
                self._stubs[address] = entry
            return entry[1]

    def _admin_ticket(self, region_uid: str, extent_id: int) -> str:
        return tickets.sign(self.secret, region_uid, [extent_id], "admin", ttl=ADMIN_TICKET_TTL)[0]

    def _reserve(self, region: RegionRecord, extent: ExtentPlace) -> None:
        request = memory_server_pb2.ReserveExtentRequest(
            ticket=self._admin_ticket(region.uid, extent.extent_id), extent_id=extent.extent_id,
            region_uid=region.uid, length=extent.length, persistent=region.persistent)
        reply = rpc.call(self._stub(extent.grpc_address).ReserveExtent, request, self.token,
                         self.reserve_timeout, errors.ServerUnavailable)
        if reply.length and reply.length < extent.length:
            raise errors.ServerError(f"reserved {reply.length} bytes, asked for {extent.length}")

    def _release(self, region_uid: str, extent: ExtentPlace) -> bool:
        request = memory_server_pb2.ReleaseExtentRequest(
            ticket=self._admin_ticket(region_uid, extent.extent_id), extent_id=extent.extent_id)
        reply = rpc.call(self._stub(extent.grpc_address).ReleaseExtent, request, self.token,
                         self.release_timeout, errors.ServerUnavailable)
        return bool(reply.released)

    def _release_all(self, region_uid: str, extents: Sequence[ExtentPlace]) -> None:
        """Release extents in parallel, best effort: a server that is down or does not
        answer keeps its extent as an orphan, freed after its next heartbeat's grace."""
        jobs = {self._pool.submit(self._release, region_uid, e): e
                for e in extents if e.server_state != "down"}
        for job, extent in jobs.items():
            try:
                job.result()
            except errors.SMBError as exc:
                log.warning("could not release extent %d on server %s (%s): %s; it will be freed "
                            "as an orphan", extent.extent_id, extent.server_id,
                            extent.grpc_address, exc)

    def _reserve_all(self, region: RegionRecord) -> RegionRecord:
        """Reserve every extent of a ``creating`` region, then commit it.

        On any failure the reserved extents are released, the region is aborted and a
        typed error naming the server is raised.
        """
        jobs = {self._pool.submit(self._reserve, region, e): e for e in region.extents}
        reserved: list[ExtentPlace] = []
        failed: list[tuple[ExtentPlace, errors.SMBError]] = []
        for job, extent in jobs.items():
            try:
                job.result()
                reserved.append(extent)
            except errors.SMBError as exc:
                failed.append((extent, exc))
            except Exception as exc:  # a bug; keep the cluster consistent anyway
                log.exception("reserving extent %d", extent.extent_id)
                failed.append((extent, errors.ServerError(str(exc))))
        if failed:
            self._release_all(region.uid, reserved)
            self.state.abort_region(region.name, region.uid)
            raise self._reserve_error(region, failed)
        try:
            return self.state.commit_region(region.name, region.uid)
        except errors.SMBError:
            self._release_all(region.uid, reserved)
            raise

    @staticmethod
    def _reserve_error(region: RegionRecord,
                       failed: list[tuple[ExtentPlace, errors.SMBError]]) -> errors.SMBError:
        oom = [(e, x) for e, x in failed if isinstance(x, errors.OutOfMemory)]
        extent, exc = (oom or failed)[0]
        cls: type[errors.SMBError] = type(exc)
        if isinstance(exc, (errors.Unavailable, errors.Timeout)):
            cls = errors.ServerUnavailable
        others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return cls(f"memory server {extent.server_id} at {extent.grpc_address} could not reserve "
                   f"{extent.length} bytes for region {region.name!r}: {exc}{others}; "
                   "nothing was created")

    # -- responses -----------------------------------------------------------------------
    def _response(self, region: RegionRecord, mode: str) -> controller_pb2.RegionResponse:
        token, expires_at = tickets.sign(self.secret, region.uid, region.extent_ids, mode,
                                         ttl=self.ticket_ttl)
        return controller_pb2.RegionResponse(
            region=region_info(region),
            ticket=common_pb2.Ticket(token=token, expires_at=expires_at, mode=mode))

    # -- membership ----------------------------------------------------------------------
    @typed_errors
    def RegisterServer(self, request: controller_pb2.RegisterServerRequest,
                       context: grpc.ServicerContext) -> Any:
        server_id, orphans = self.state.register_server(
            request.server_id, request.host_id, request.grpc_address, list(request.endpoints),
            request.capacity_bytes, _held(request.extents))
        return controller_pb2.RegisterServerResponse(
            server_id=server_id, lease_seconds=self.state.lease_seconds, orphan_extent_ids=orphans)

    @typed_errors
    def Heartbeat(self, request: controller_pb2.HeartbeatRequest,
                  context: grpc.ServicerContext) -> Any:
        orphans = self.state.heartbeat(request.server_id, _held(request.extents))
        return controller_pb2.HeartbeatResponse(lease_seconds=self.state.lease_seconds,
                                                orphan_extent_ids=orphans)

    @typed_errors
    def UnregisterServer(self, request: controller_pb2.UnregisterServerRequest,
                         context: grpc.ServicerContext) -> Any:
        server = self.state.unregister(request.server_id, request.reason)
        return controller_pb2.UnregisterServerResponse(server=server_info(server))

    @typed_errors
    def DrainServer(self, request: controller_pb2.DrainServerRequest,
                    context: grpc.ServicerContext) -> Any:
        server = self.state.drain(request.server_id, undrain=request.undrain)
        return controller_pb2.DrainServerResponse(server=server_info(server))

    @typed_errors
    def ListServers(self, request: controller_pb2.ListServersRequest,
                    context: grpc.ServicerContext) -> Any:
        return controller_pb2.ListServersResponse(
            servers=[server_info(s) for s in self.state.list_servers()])

    # -- regions -------------------------------------------------------------------------
    @typed_errors
    def CreateRegion(self, request: controller_pb2.CreateRegionRequest,
                     context: grpc.ServicerContext) -> Any:
        deadline = time.monotonic() + EXIST_OK_WAIT
        while True:
            try:
                region = self.state.begin_create_region(
                    request.name, request.size, request.placement, request.stripe_unit,
                    request.num_servers, list(request.segment_sizes), request.persistent)
                break
            except errors.RegionExists:
                if not request.exist_ok:
                    raise
                try:
                    existing = self.state.get_region(request.name)
                except errors.RegionNotFound:  # another caller is creating it right now
                    if time.monotonic() > deadline:
                        raise errors.RegionExists(
                            f"region {request.name!r} is still being created after "
                            f"{EXIST_OK_WAIT:g} s; try again") from None
                    time.sleep(EXIST_OK_POLL)
                    continue
                self._check_same(existing, request)
                return self._response(existing, "rw")
        return self._response(self._reserve_all(region), "rw")

    @staticmethod
    def _check_same(existing: RegionRecord, request: controller_pb2.CreateRegionRequest) -> None:
        """exist_ok returns an existing region only if it is the one asked for."""
        if request.size and request.size != existing.size:
            raise errors.RegionExists(f"region {existing.name!r} exists with {existing.size} bytes, "
                                      f"not {request.size}; delete it or use another name")
        if request.placement and request.placement != existing.placement:
            raise errors.RegionExists(f"region {existing.name!r} exists with {existing.placement} "
                                      f"placement, not {request.placement}")

    @typed_errors
    def OpenRegion(self, request: controller_pb2.OpenRegionRequest,
                   context: grpc.ServicerContext) -> Any:
        mode = request.mode or "rw"
        if mode not in TICKET_MODES:
            raise errors.InvalidArgument(f"mode must be one of {', '.join(TICKET_MODES)}, got {mode!r}")
        return self._response(self.state.get_region(request.name), mode)

    @typed_errors
    def DeleteRegion(self, request: controller_pb2.DeleteRegionRequest,
                     context: grpc.ServicerContext) -> Any:
        region = self.state.get_region(request.name)
        extents = self.state.delete_region(request.name)
        self._release_all(region.uid, extents)
        return controller_pb2.DeleteRegionResponse()

    @typed_errors
    def ListRegions(self, request: controller_pb2.ListRegionsRequest,
                    context: grpc.ServicerContext) -> Any:
        return controller_pb2.ListRegionsResponse(
            regions=[region_info(r) for r in self.state.list_regions(request.prefix)])

    # -- coordination --------------------------------------------------------------------
    @typed_errors
    def Barrier(self, request: controller_pb2.BarrierRequest, context: grpc.ServicerContext) -> Any:
        generation, arrival = self.barriers.wait(
            request.name, request.parties, request.timeout_seconds or None, is_active=context.is_active)
        return controller_pb2.BarrierResponse(generation=generation, arrival=arrival)
