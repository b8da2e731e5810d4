"""The client: a session to the controller and the factory of region handles."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from . import rpc, transports, verbs
from ._proto.smb.v1 import controller_pb2 as pb
from ._proto.smb.v1 import controller_pb2_grpc as pb_grpc
from .addressing import parse_endpoint
from .errors import ControllerUnavailable, InvalidArgument, SMBError
from .hostinfo import host_id
from .region import ExtentPlace, Region
from .transports import Session

log = logging.getLogger(__name__)

DEFAULT_CONTROLLER = "127.0.0.1:7700"
TRANSPORT_POLICIES = ("auto", "tcp", "shm", "rdma")


@dataclass(frozen=True)
class ServerStatus:
    server_id: str
    host_id: str
    grpc_address: str
    endpoints: tuple[str, ...]
    capacity: int       # bytes
    used: int           # bytes
    state: str          # up | down | draining
    last_heartbeat: float
    extents: int


@dataclass(frozen=True)
class RegionStatus:
    name: str
    size: int           # bytes
    placement: str
    servers: tuple[str, ...]
    state: str
    persistent: bool
    created_at: float


def choose_endpoint(place: ExtentPlace, policy: str, here: str) -> str:
    """The data-plane URI to use for a server, by policy (``auto`` prefers shm on the
    same host, then rdma where this client can do verbs, then tcp)."""
    offered = {uri.partition("://")[0]: uri for uri in place.endpoints}
    if policy != "auto":
        if policy not in offered:
            raise InvalidArgument(
                f"server {place.server_id} does not offer {policy}://; it offers "
                + (", ".join(sorted(offered)) or "nothing"))
        if policy == "shm" and place.host_id != here:
            raise InvalidArgument(f"shm needs the client on the server's host ({place.server_id})")
        return offered[policy]
    if "shm" in offered and place.host_id == here:
        return offered["shm"]
    if "rdma" in offered and "rdma" in transports.TRANSPORTS and verbs.has_device():
        return offered["rdma"]
    if "tcp" in offered:
        return offered["tcp"]
    raise InvalidArgument(f"server {place.server_id} offers no usable transport: {sorted(offered)}")


class Client:
    """A connection to a Soft Memory Box cluster.

    ``address`` is the controller's ``host:port`` (default ``$SMB_CONTROLLER`` or
    127.0.0.1:7700); ``token`` the bearer token (default ``$SMB_TOKEN``); ``transport``
    one of auto, tcp, shm, rdma (default ``$SMB_TRANSPORT`` or auto). ``connections``
    is the number of sockets per memory server and region; ``chunk_bytes`` the largest
    single request; ``reconnect_timeout`` how long control calls keep retrying while the
    controller is unreachable (e.g. restarting) before ControllerUnavailable.
    ``transport_options`` go to every data-plane session on top of those (for example
    ``{"max_message": 65536}`` for rdma; see each transport's session class). The client
    owns its channel and thread pools; :meth:`close` them.
    """

    def __init__(self, address: str | None = None, token: str | None = None, *,
                 transport: str | None = None, timeout: float = 30.0, connections: int = 2,
                 chunk_bytes: int = 8 << 20, io_threads: int = 16,
                 reconnect_timeout: float = 5.0,
                 transport_options: dict[str, Any] | None = None) -> None:
        self.address = address or os.environ.get("SMB_CONTROLLER", DEFAULT_CONTROLLER)
        self.token = token if token is not None else os.environ.get("SMB_TOKEN", "")
        self.transport = (transport or os.environ.get("SMB_TRANSPORT", "") or "auto").lower()
        if self.transport not in TRANSPORT_POLICIES:
            raise InvalidArgument(f"unknown transport {self.transport!r}: expected one of "
                                  + ", ".join(TRANSPORT_POLICIES))
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.transport_options = dict(transport_options or {})
        self._channel = rpc.channel(self.address)
        self._stub = pb_grpc.ControllerStub(self._channel)
        self._io_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="smb-io")
        self._async_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="smb-async")
        self._here = host_id()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._async_pool.shutdown(wait=True)
        self._io_pool.shutdown(wait=True)
        self._channel.close()

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """One controller call; while the controller is unreachable (restarting), retry
        with a short backoff for up to ``reconnect_timeout`` seconds, then raise
        ControllerUnavailable."""
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                return rpc.call(getattr(self._stub, method), request, self.token,
                                self.timeout if timeout is None else timeout, ControllerUnavailable)
            except ControllerUnavailable:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    # -- regions -------------------------------------------------------------------
    def create_region(self, name: str, size: int, *, placement: str = "striped",
                      stripe_unit: int = 0, num_servers: int = 0,
                      segment_sizes: Sequence[int] = (), persistent: bool = False,
                      exist_ok: bool = False) -> Region:
        """Create a region of ``size`` bytes and return a read-write handle.

        ``placement``: ``striped`` (``stripe_unit`` bytes round-robin over
        ``num_servers``, 0 = all), ``layered`` (``segment_sizes``, each segment whole
        on one server) or ``single``. Raises RegionExists unless ``exist_ok``,
        OutOfMemory when it does not fit.
        """
        resp = self._call("CreateRegion", pb.CreateRegionRequest(
            name=name, size=size, placement=placement, stripe_unit=stripe_unit,
            num_servers=num_servers, segment_sizes=list(segment_sizes),
            persistent=persistent, exist_ok=exist_ok))
        return Region(self, resp.region, resp.ticket, "rw")

    def _open(self, name: str, mode: str) -> tuple[Any, Any]:
        resp = self._call("OpenRegion", pb.OpenRegionRequest(name=name, mode=mode))
        return resp.region, resp.ticket

    def open_region(self, name: str, mode: str = "rw") -> Region:
        """Attach to an existing region by name; ``mode`` is ``rw`` or ``ro``."""
        info, ticket = self._open(name, mode)
        return Region(self, info, ticket, mode)

    def delete_region(self, name: str) -> None:
        """Delete a region; its memory is freed and old handles stop working."""
        self._call("DeleteRegion", pb.DeleteRegionRequest(name=name))

    def list_regions(self, prefix: str = "") -> list[RegionStatus]:
        resp = self._call("ListRegions", pb.ListRegionsRequest(prefix=prefix))
        return [RegionStatus(r.name, r.size, r.placement, tuple(e.server_id for e in r.extents),
                             r.state, r.persistent, r.created_at) for r in resp.regions]

    # -- cluster -------------------------------------------------------------------
    def list_servers(self) -> list[ServerStatus]:
        resp = self._call("ListServers", pb.ListServersRequest())
        return [ServerStatus(s.server_id, s.host_id, s.grpc_address, tuple(s.endpoints),
                             s.capacity_bytes, s.used_bytes, s.state, s.last_heartbeat, s.extents)
                for s in resp.servers]

    def drain_server(self, server_id: str, undrain: bool = False) -> ServerStatus:
        s = self._call("DrainServer", pb.DrainServerRequest(server_id=server_id, undrain=undrain)).server
        return ServerStatus(s.server_id, s.host_id, s.grpc_address, tuple(s.endpoints),
                            s.capacity_bytes, s.used_bytes, s.state, s.last_heartbeat, s.extents)

    def barrier(self, name: str, parties: int, timeout: float | None = None) -> int:
        """Block until ``parties`` callers reached barrier ``name``; returns its generation.

        Raises BarrierTimeout after ``timeout`` seconds (None: wait forever).
        """
        request = pb.BarrierRequest(name=name, parties=parties, timeout_seconds=timeout or 0.0)
        grpc_timeout = None if timeout is None else timeout + 10.0
        return self._call("Barrier", request, timeout=grpc_timeout).generation

    # -- data plane ----------------------------------------------------------------
    def _open_session(self, place: ExtentPlace, ticket: str, mode: str) -> Session:
        uri = choose_endpoint(place, self.transport, self._here)
        endpoint = parse_endpoint(uri)
        options: dict[str, Any] = {"connections": self.connections,
                                   "grpc_address": place.grpc_address, "token": self.token}
        tcp = [u for u in place.endpoints if u.startswith("tcp://")]
        if tcp:
            options["tcp_endpoint"] = tcp[0]
        options.update(self.transport_options)
        try:
            factory = transports.TRANSPORTS[endpoint.scheme]
        except KeyError:
            raise InvalidArgument(f"no {endpoint.scheme} transport in this client; have "
                                  + ", ".join(transports.available())) from None
        log.debug("server %s via %s", place.server_id, uri)
        return factory(endpoint, ticket, mode, options)


def connect(address: str | None = None, token: str | None = None, **kwargs: Any) -> Client:
    """Connect to the controller at ``address`` (``host:port``); see :class:`Client`."""
    return Client(address, token, **kwargs)


__all__ = ["Client", "connect", "ServerStatus", "RegionStatus", "SMBError"]
