"""The client: a session to the controller and the factory of region handles.

The client owns its gRPC channel and its :class:`~smb_client.dataplane.DataPlane` (one
data-plane session per memory-server endpoint, shared by every region, and the thread
pools). Regions use the client only through their :class:`~smb_client.route.Route`, which
needs :attr:`Client.dataplane`, :meth:`Client.open_info`, :meth:`Client.delete_region`
and :attr:`Client.chunk_bytes` (the :class:`~smb_client.route.RegionSource` protocol).
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from smb_protocol import rpc, tracing
from smb_protocol._proto.smb.v1 import controller_pb2 as pb
from smb_protocol._proto.smb.v1 import controller_pb2_grpc as pb_grpc
from smb_protocol.errors import Closed, ControllerUnavailable, InvalidArgument, RegionNotFound, SMBError, Timeout
from smb_protocol.hostinfo import host_id
from smb_protocol.names import check_region_name
from smb_protocol.placement import MAX_REPLICAS, check_bytes, check_weights
from smb_protocol.retry import Backoff, Retry
from smb_protocol.tickets import TicketMode
from smb_protocol.tls import TLSConfig, diagnose

from .dataplane import TRANSPORT_POLICIES, DataPlane, choose_endpoint
from .metrics import serve_from_env, timed_method
from .region import Region

MAX_LEASE = 7 * 24 * 3600.0   # seconds: the longest owner lease a controller takes
log = logging.getLogger(__name__)

DEFAULT_CONTROLLER = "127.0.0.1:7700"
RECONNECT_FIRST = 0.05       # seconds before the first retry of an unreachable controller
RECONNECT_CAP = 0.25         # seconds between retries (rounds of a controller list) at most
SOCKET_CLOSED = "Socket closed"   # gRPC's words for a connection the server closed at once


def reconnect_backoff(controllers: int) -> Backoff:
    """The delays (seconds) between tries of an unreachable controller: over a list of
    ``controllers`` (one leads, the others stand by and refuse), each failure moves to
    the next at once and only a whole round waits, so that a standby that just took
    over is reached within ``RECONNECT_CAP`` of its first answer."""
    return Backoff(first=RECONNECT_FIRST, cap=RECONNECT_CAP, per_round=max(1, controllers))


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
    evacuating: bool = False   # draining, and its copies are being moved to other servers
    moved_bytes: int = 0       # evacuating: bytes moved off it so far, and their rate (bytes/s)
    move_rate: float = 0.0

    @classmethod
    def from_message(cls, s: Any) -> ServerStatus:
        """From a protobuf ``ServerInfo``."""
        return cls(s.server_id, s.host_id, s.grpc_address, tuple(s.endpoints), s.capacity_bytes,
                   s.used_bytes, s.state, s.last_heartbeat, s.extents, s.evacuating, s.moved_bytes, s.move_rate)


@dataclass(frozen=True)
class RebalanceStatus:
    """Where a rebalance stands: moves planned or copying, bytes still to move for an
    even share, bytes moved (by rebalances and evacuations) since the leader started."""

    running: bool
    bytes_left: int
    bytes_moved: int


@dataclass(frozen=True)
class RegionStatus:
    name: str
    size: int           # bytes
    placement: str
    servers: tuple[str, ...]
    state: str          # ready | degraded | lost
    persistent: bool
    created_at: float
    replicas: int = 1   # copies of every byte
    copy_servers: tuple[str, ...] = ()  # the servers of the other copies (backups, syncing)


class Client:
    """A connection to a Soft Memory Box cluster.

    ``address`` is the controller's ``host:port`` (default ``$SMB_CONTROLLER`` or
    127.0.0.1:7700), or a comma-separated list of controllers sharing one etcd store
    (calls go to whichever leads, moving on at failover); ``token`` the bearer token
    (default ``$SMB_TOKEN``); ``transport``
    one of auto, tcp, shm, rdma (default ``$SMB_TRANSPORT`` or auto). ``connections``
    is the number of connections per memory server, shared by all of this client's
    regions; ``chunk_bytes`` the largest single request; ``reconnect_timeout`` how long
    control calls keep retrying while the controller is unreachable (e.g. restarting)
    before ControllerUnavailable. ``transport_options`` go to every data-plane session
    on top of those (for example ``{"max_message": 65536}`` for rdma; see each
    transport's session class). ``tls`` holds the CA, certificate and key for TLS to the
    controller and the memory servers (default: ``$SMB_TLS_CA``, ``$SMB_TLS_CERT``,
    ``$SMB_TLS_KEY``; a wrong CA raises AuthenticationError). The client owns its channel and its :attr:`dataplane`;
    :meth:`close` closes both, after which its regions stop working. With
    ``$SMB_CLIENT_METRICS_PORT`` set, the process serves its operations' latency
    histograms there (:mod:`smb_client.metrics`); with ``$SMB_OTEL_*`` or the
    OpenTelemetry variables set, it traces them (:mod:`smb_protocol.tracing`).
    """

    def __init__(self, address: str | None = None, token: str | None = None, *,
                 transport: str | None = None, timeout: float = 30.0, connections: int = 2,
                 chunk_bytes: int = 8 << 20, io_threads: int = 16,
                 reconnect_timeout: float = 5.0,
                 transport_options: dict[str, Any] | None = None,
                 tls: TLSConfig | None = None) -> None:
        self.address = address or os.environ.get("SMB_CONTROLLER", "") or DEFAULT_CONTROLLER
        # where the address came from, for the error that says it cannot be reached
        self._address_origin = ("as given" if address else "from SMB_CONTROLLER"
                                if os.environ.get("SMB_CONTROLLER") else
                                "the default: SMB_CONTROLLER is not set")
        self.token = token if token is not None else os.environ.get("SMB_TOKEN", "")
        self.transport = (transport or os.environ.get("SMB_TRANSPORT", "") or "auto").lower()
        if self.transport not in TRANSPORT_POLICIES:
            raise InvalidArgument(f"unknown transport {self.transport!r}: expected one of "
                                  + ", ".join(TRANSPORT_POLICIES))
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise InvalidArgument(f"chunk_bytes must be a positive number of bytes, not {chunk_bytes!r}")
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.transport_options = dict(transport_options or {})
        serve_from_env()
        tracing.setup_from_env("smb-client")
        self.tls = TLSConfig.from_env() if tls is None else tls
        if self.tls.enabled:
            self.tls.client_context()   # unreadable or mismatched files: InvalidArgument now
        self.dataplane = DataPlane(self.transport, host_id(), connections=connections, token=self.token,
                                   io_threads=io_threads,
                                   transport_options={"tls": self.tls, **self.transport_options})
        self._closed = False
        # owner leases: regions created with lease= are kept while this client renews
        self.owner = uuid.uuid4().hex
        self._lease_seconds = 0.0                # the shortest lease asked for; 0: none yet
        self._lease_stop = threading.Event()
        self._lease_lock = threading.Lock()
        self._lease_thread: threading.Thread | None = None
        # a comma-separated list names a leader and its standbys: calls go to one; when it
        # is unavailable (a standby refuses, or it does not answer) the next is tried
        self.controllers = [a.strip() for a in self.address.split(",") if a.strip()] or [DEFAULT_CONTROLLER]
        self._leader = 0  # index in self.controllers of the one calls go to
        self._stubs: dict[str, tuple[Any, Any]] = {}  # address -> (channel, stub)
        self._stubs_lock = threading.Lock()

    @property
    def controller(self) -> str:
        """The controller calls go to now: of a list, the leader once a call found it."""
        return self.controllers[self._leader]

    def _stub(self, address: str) -> Any:
        with self._stubs_lock:
            if address not in self._stubs:
                channel = rpc.channel(address, self.tls)
                stub = pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]  # generated stub, untyped __init__
                self._stubs[address] = (channel, stub)
            return self._stubs[address][1]

    def __enter__(self) -> Client:
        """The client itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close`."""
        self.close()

    def close(self) -> None:
        """Close the data plane (after submitted work ends) and the controller channel.
        Regions this client created with a lease are deleted once the lease runs out."""
        self._lease_stop.set()
        if self._lease_thread is not None and self._lease_thread is not threading.current_thread():
            self._lease_thread.join(timeout=self.timeout)
        self._closed = True
        self.dataplane.close()
        with self._stubs_lock:
            for channel, _ in self._stubs.values():
                channel.close()

    def _call(self, method: str, request: Any, timeout: float | None = None,
              reconnect_timeout: float | None = None) -> Any:
        """One controller call; while the controller is unreachable (restarting), retry
        with backoff for up to ``reconnect_timeout`` seconds (default: the client's),
        then raise ControllerUnavailable (Closed, at once, on a closed client)."""
        if self._closed:
            raise Closed(self._closed_text(method))
        deadline = self.timeout if timeout is None else timeout
        patience = self.reconnect_timeout if reconnect_timeout is None else reconnect_timeout
        retry = Retry(on=(ControllerUnavailable,), timeout=patience,
                      backoff=reconnect_backoff(len(self.controllers)))
        try:
            return retry(lambda: self._call_once(method, request, deadline), what=f"controller {method}")
        except ControllerUnavailable as exc:
            if self._closed:    # closed meanwhile: that, not the channel it closed, is the cause
                raise Closed(self._closed_text(method)) from exc
            if type(exc) is not ControllerUnavailable:
                raise     # ControllerBusy answered
            raise ControllerUnavailable(self._unreachable(exc, patience)) from None

    @staticmethod
    def _closed_text(method: str) -> str:
        return (f"controller {method}: the client is closed (Client.close was called); "
                "make a new one with smb_client.connect()")

    def _unreachable(self, exc: ControllerUnavailable, patience: float) -> str:
        """The message of a controller that did not answer: the address tried, where it
        came from, and what to check."""
        detail = str(exc)
        if "failed to connect" in detail.lower():   # gRPC's words; the reason is at the end
            detail = detail.rpartition(": ")[2] or detail
        return (f"cannot reach the controller at {self.address} ({self._address_origin}) within "
                f"{patience:g} s: {detail}; check that the controller runs there and that "
                "SMB_CONTROLLER (or the address passed) names its host:port")

    def _call_once(self, method: str, request: Any, deadline: float | None) -> Any:
        index = self._leader
        address = self.controllers[index]
        try:
            return rpc.call(getattr(self._stub(address), method), request, self.token, deadline,
                            ControllerUnavailable)
        except ControllerUnavailable as exc:
            # a controller that closes the connection at once may be refusing TLS (or its
            # absence): ask it with a handshake of our own, so the error says what to set
            if SOCKET_CLOSED in str(exc):
                refusal = diagnose(address, self.tls)
                if refusal is not None:
                    raise refusal from None
            if len(self.controllers) > 1:  # the next try goes to the next of the list
                self._leader = (index + 1) % len(self.controllers)
            raise
        except Timeout as exc:
            # of a list, a controller that does not answer in time (paused, hung) may have
            # been replaced by a standby: try the next (a lone controller's timeout stands)
            if len(self.controllers) > 1 and type(exc) is Timeout:
                self._leader = (index + 1) % len(self.controllers)
                raise ControllerUnavailable(f"controller {address} did not answer within "
                                            f"{deadline} s; trying the next of the list") from None
            raise

    # -- regions -------------------------------------------------------------------
    @tracing.traced("create")
    def create_region(self, name: str, size: int, *, placement: str = "striped",
                      stripe_unit: int = 0, num_servers: int = 0,
                      segment_sizes: Sequence[int] = (), persistent: bool = False,
                      exist_ok: bool = False, lease: float | None = None,
                      replicas: int = 1, server_weights: Mapping[str, float] | None = None) -> Region:
        """Create a region of ``size`` bytes and return a read-write handle.

        ``placement``: ``striped`` (``stripe_unit`` bytes round-robin over
        ``num_servers``, 0 = all), ``layered`` (``segment_sizes``, each segment whole
        on one server) or ``single``. ``server_weights`` (layered only; server id ->
        weight): the segments go to those servers only, each server's bytes in
        proportion to its weight (within one segment). Raises InvalidArgument for a size that is not a
        positive whole number of bytes below 2**63 (and the like), RegionExists unless
        ``exist_ok``, OutOfMemory when it does not fit.

        ``lease`` (seconds): the region belongs to this client, which renews its lease in
        the background (every third of the shortest lease it holds); once nobody renewed
        it for ``lease`` seconds (the process died or was cut off, or :meth:`close` was
        called), the controller deletes it. None: it stays until deleted.

        ``replicas`` (1 to 3): copies of every byte, each on another memory server (on
        another host where there are enough). Writes and accumulates reach every live
        copy before they are acknowledged; when a server holding a copy dies the region
        keeps serving (``degraded``) and the controller copies it to another server.
        OutOfMemory when fewer than ``replicas`` servers can take it.
        """
        # also checked by the controller; a name too large for one gRPC message fails in the channel
        check_region_name(name)
        check_bytes("size", size, minimum=1)
        check_bytes("stripe_unit", stripe_unit, minimum=0)
        if not isinstance(num_servers, int) or isinstance(num_servers, bool) or not 0 <= num_servers < 1 << 31:
            raise InvalidArgument(f"num_servers must be a whole number >= 0 (0: all servers), not {num_servers!r}")
        for k, seg in enumerate(segment_sizes):
            check_bytes(f"segment_sizes[{k}]", seg, minimum=1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas must be 1 to {MAX_REPLICAS}, not {replicas!r}")
        if lease is not None and not (isinstance(lease, (int, float)) and 0 < lease <= MAX_LEASE):
            raise InvalidArgument(f"lease must be more than 0 and at most {MAX_LEASE:g} seconds, not {lease!r}")
        if server_weights is not None:
            if placement != "layered":
                raise InvalidArgument(f"server_weights are for layered placement, not {placement!r}")
            if num_servers:
                raise InvalidArgument("num_servers and server_weights exclude each other: the weights name the servers")
            server_weights = check_weights(server_weights)
        resp = self._call("CreateRegion", pb.CreateRegionRequest(
            name=name, size=size, placement=placement, stripe_unit=stripe_unit,
            num_servers=num_servers, segment_sizes=list(segment_sizes),
            persistent=persistent, exist_ok=exist_ok,
            # one uid for every attempt: a retry after a lost reply gets the region it made
            uid=uuid.uuid4().hex,
            owner=self.owner if lease else "", lease_seconds=float(lease or 0.0), replicas=replicas,
            server_weights=dict(server_weights or {})))
        if lease:
            self._keep_leases(float(lease))
        return Region(self, resp.region, resp.ticket, TicketMode.RW)

    def _keep_leases(self, seconds: float) -> None:
        """Renew this client's owner lease every third of the shortest lease asked for."""
        with self._lease_lock:
            self._lease_seconds = min(self._lease_seconds or seconds, seconds)
            if self._lease_thread is None:
                self._lease_thread = threading.Thread(target=self._renew_loop, name="smb-leases", daemon=True)
                self._lease_thread.start()

    def _renew_loop(self) -> None:
        while not self._lease_stop.wait(self._lease_seconds / 3):
            try:
                held = self._call("RenewLease", pb.RenewLeaseRequest(owner=self.owner),
                                  reconnect_timeout=self._lease_seconds / 3).regions
            except SMBError as exc:
                log.warning("could not renew the lease of this client's regions: %s", exc)
                continue
            if not held:
                log.debug("no leased region left to renew")

    def open_info(self, name: str, mode: str | TicketMode = TicketMode.RW,
                  reconnect_timeout: float | None = None) -> tuple[Any, Any]:
        """Open region ``name`` at the controller: its description (extents, layout) and
        a fresh ticket (``.token``, ``.expires_at`` in unix seconds). Regions call this
        to renew their ticket. ``reconnect_timeout``: seconds to keep trying while the
        controller is unreachable (default: the client's)."""
        check_region_name(name)
        resp = self._call("OpenRegion", pb.OpenRegionRequest(name=name, mode=_mode(mode).value),
                          reconnect_timeout=reconnect_timeout)
        return resp.region, resp.ticket

    @timed_method("open")
    def open_region(self, name: str, mode: str | TicketMode = TicketMode.RW) -> Region:
        """Attach to an existing region by name; ``mode`` is ``rw`` or ``ro``."""
        mode = _mode(mode)
        info, ticket = self.open_info(name, mode)
        return Region(self, info, ticket, mode)

    def delete_region(self, name: str) -> None:
        """Delete a region; its memory is freed and old handles stop working."""
        # one request id for every attempt: a retry after a lost reply is answered as done
        self._call("DeleteRegion", pb.DeleteRegionRequest(name=name, request_id=uuid.uuid4().hex))

    def delete_regions(self, prefix: str) -> list[str]:
        """Delete every region whose name starts with ``prefix`` (e.g. a job's
        ``"job/"``) and return their names. An empty prefix is refused with
        InvalidArgument (it would name every region); a region deleted meanwhile by
        someone else is skipped."""
        if not prefix:
            raise InvalidArgument("delete_regions needs a non-empty name prefix, e.g. 'job/'")
        deleted = []
        for region in self.list_regions(prefix):
            try:
                self.delete_region(region.name)
            except RegionNotFound:
                continue
            deleted.append(region.name)
        return deleted

    def list_regions(self, prefix: str = "") -> list[RegionStatus]:
        """The regions whose names start with ``prefix`` (all: ""), with where they live."""
        resp = self._call("ListRegions", pb.ListRegionsRequest(prefix=prefix))
        return [RegionStatus(r.name, r.size, r.placement, tuple(e.server_id for e in r.extents),
                             r.state, r.persistent, r.created_at, max(1, r.replicas),
                             tuple(e.server_id for e in r.copies)) for r in resp.regions]

    # -- cluster -------------------------------------------------------------------
    def list_servers(self) -> list[ServerStatus]:
        """Every memory server the controller knows, by id."""
        resp = self._call("ListServers", pb.ListServersRequest())
        return [ServerStatus.from_message(s) for s in resp.servers]

    def drain_server(self, server_id: str, undrain: bool = False, evacuate: bool = False) -> ServerStatus:
        """Stop placing new extents on a server (admin); ``evacuate``: also move every
        copy it holds to other servers while clients keep using them (done when its
        status shows 0 extents); ``undrain``: take new extents again."""
        s = self._call("DrainServer", pb.DrainServerRequest(server_id=server_id, undrain=undrain,
                                                            evacuate=evacuate)).server
        return ServerStatus.from_message(s)

    def remove_server(self, server_id: str) -> ServerStatus:
        """Forget a drained server that holds nothing (admin); InvalidArgument while it
        is up or holds extents."""
        return ServerStatus.from_message(self._call("RemoveServer", pb.RemoveServerRequest(server_id=server_id)).server)

    def rebalance(self, bytes_per_second: float = 0.0, stop: bool = False) -> RebalanceStatus:
        """Start (or go on with) moving copies until every up server holds an even share
        of bytes (admin), at most ``bytes_per_second`` on average (0: no limit);
        ``stop``: start no more moves. Returns where it stands; call again to follow it."""
        r = self._call("Rebalance", pb.RebalanceRequest(bytes_per_second=bytes_per_second, stop=stop))
        return RebalanceStatus(r.running, r.bytes_left, r.bytes_moved)

    @timed_method("barrier")
    def barrier(self, name: str, parties: int, timeout: float | None = None, *,
                rank: int | None = None) -> int:
        """Block until ``parties`` callers reached barrier ``name``; returns its generation.

        Raises BarrierTimeout after ``timeout`` seconds (None: wait forever), whose
        ``arrived`` and ``parties`` count the callers; when every caller gave its ``rank``
        (0 .. parties-1), its ``missing`` lists the ranks that did not come and its
        message names them ("; missing: rank 3"). Every retry of the call (a failover) names the
        same arrival, so that it is counted once.
        """
        request = pb.BarrierRequest(name=name, parties=parties, timeout_seconds=timeout or 0.0,
                                    arrival_id=uuid.uuid4().hex, rank=rank)
        grpc_timeout = None if timeout is None else timeout + 10.0
        return int(self._call("Barrier", request, timeout=grpc_timeout).generation)

    # -- data plane ----------------------------------------------------------------
    def open_sessions(self) -> dict[str, str]:
        """The data-plane sessions this client holds: endpoint URI -> transport scheme."""
        return {uri: s.scheme for uri, s in self.dataplane.sessions().items()}


def _mode(mode: object) -> TicketMode:
    try:
        parsed = TicketMode.parse(mode.value if isinstance(mode, TicketMode) else str(mode))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if parsed in (TicketMode.ADMIN, TicketMode.REPLICA):
        raise InvalidArgument("regions open in mode rw or ro; admin and replica tickets are the servers'")
    return parsed


def connect(address: str | None = None, token: str | None = None, *, transport: str | None = None,
            timeout: float = 30.0, connections: int = 2, chunk_bytes: int = 8 << 20, io_threads: int = 16,
            reconnect_timeout: float = 5.0, transport_options: dict[str, Any] | None = None,
            tls: TLSConfig | None = None) -> Client:
    """Connect to the controller at ``address`` (``host:port``); the options are
    :class:`Client`'s. The caller owns the client: use it in a ``with`` block or close it."""
    return Client(address, token, transport=transport, timeout=timeout, connections=connections,
                  chunk_bytes=chunk_bytes, io_threads=io_threads, reconnect_timeout=reconnect_timeout,
                  transport_options=transport_options, tls=tls)


__all__ = ["Client", "connect", "ServerStatus", "RegionStatus", "SMBError", "choose_endpoint"]
