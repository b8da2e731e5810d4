"""The memory server daemon: lifecycle, controller registration and heartbeats.

:class:`MemoryServer` builds the arena, the gRPC service and the data planes, then
registers with the controller from a background thread (retrying with backoff while
the controller is unreachable) and heartbeats every ``heartbeat_seconds`` (and at once
when a primary here marks a backup failed: the heartbeat reports it). Extents the
controller reports as orphans (held here, unknown there, past its grace period) are
released. Data keeps being served while the controller is away.

Stopping (:meth:`MemoryServer.stop`, which SIGTERM and SIGINT trigger under
``smb server``): the gRPC health service turns ``NOT_SERVING``, systemd hears
``STOPPING=1``, heartbeats end, the controller is told (``UnregisterServer``: the
server is marked down at once rather than after its lease), then the planes close
and every extent is released: memory extents are zeroed out and their pages given
back (a shm client that still maps one sees its live word at 0), file-backed
extents are flushed and kept for the next start.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import uuid
from typing import Any

from smb_protocol import errors, rpc
from smb_protocol._proto.smb.v1 import controller_pb2, controller_pb2_grpc, memory_server_pb2_grpc
from smb_protocol.addressing import format_hostport
from smb_protocol.hostinfo import host_id
from smb_protocol.rdma import verbs
from smb_protocol.retry import Backoff
from smb_protocol.tls import TLS_SCHEME
from smb_server.runtime import rpc_tracing, sdnotify
from smb_server.runtime.config import ServerConfig
from smb_server.runtime.credentials import server_credential
from smb_server.runtime.daemon import Daemon, Status, write_atomic
from smb_server.runtime.grpc_util import BearerAuth, add_port, make_server, tls_settings
from smb_server.runtime.health import HEALTH_METHODS, Health
from smb_server.runtime.metrics import MetricsServer, Registry
from smb_server.runtime.rpc_metrics import RpcMetrics

from .arena import Arena
from .controller_link import ControllerLink, Controllers
from .keeper_link import ExtentKeeper, close_arena, open_arena
from .memmap import raise_fd_limit
from .metrics import add_server_metrics
from .node import Node
from .rdma_plane import RdmaPlane
from .service import TICKET_METHODS, MemoryServerServicer
from .shm_plane import ShmPlane
from .stats import PlaneStats
from .tcp_plane import TcpPlane

log = logging.getLogger(__name__)

RPC_TIMEOUT = 5.0          # seconds per controller call
UNREGISTER_TIMEOUT = 2.0   # seconds the goodbye to the controller may take at stop()
BACKOFF_FIRST = 0.1        # seconds before the first retry of a failed registration
BACKOFF_MAX = 5.0          # seconds, the longest pause between retries
BACKOFF_JITTER = 0.2       # fraction of each pause drawn at random (servers restarted together)
GRPC_GRACE = 1.0           # seconds in-flight calls get at stop()
SOCKET_NAME = "shm.sock"
MAX_UNIX_PATH = 100        # bytes; sun_path holds 108 including the NUL


class MemoryServer(Daemon):
    """One memory server. ``with MemoryServer(cfg) as s:`` starts and stops it.

    Status (:class:`..daemon.Daemon`): ``starting`` -> ``running`` -> ``closing`` ->
    ``closed``. Owns everything it opens (arena, planes, gRPC server, a temporary state
    dir) and closes it in :meth:`stop`.
    """

    kind = "memory server"

    def __init__(self, config: ServerConfig) -> None:
        super().__init__()
        self.config = config
        self.server_id = ""
        self.grpc_address = ""
        self.endpoints: list[str] = []
        self.stats = PlaneStats()
        self.node: Node | None = None   # what the planes and the servicer share
        self.arena: Arena | None = None
        self.keeper: ExtentKeeper | None = None   # holds persistent extents' memory across a crash
        self.tcp: TcpPlane | None = None
        self.shm: ShmPlane | None = None
        self.rdma: RdmaPlane | None = None
        self.registered = threading.Event()
        self.lease_seconds = 0.0
        self.registry = Registry()
        self._metrics: MetricsServer | None = None
        self._health: Health | None = None
        self._grpc: Any = None
        self._controllers: Controllers | None = None  # the controller list (leader and standbys)
        self._link: ControllerLink | None = None
        self._tmp_dirs: list[str] = []
        self._state_dir = ""
        self._announced = False

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def state(self) -> str:
        """The status as a string (kept for callers of the earlier attribute)."""
        return self.status.value

    def start(self) -> MemoryServer:
        """Bring up arena, gRPC service and data planes; register in the background.

        Returns once the server serves data; use :meth:`wait_registered` to wait for the
        controller.
        """
        return super().start()

    def _start(self) -> None:
        cfg = self.config
        self._state_dir = cfg.state_dir or self._mkdtemp()
        os.makedirs(self._state_dir, exist_ok=True)
        self.server_id = cfg.server_id or self._load_server_id()
        soft, _hard = raise_fd_limit()   # each extent and each connection takes a descriptor
        log.info("descriptor limit: %d", soft)
        self.arena, self.keeper = open_arena(cfg.capacity, cfg.data_dir, cfg.writeback_seconds, cfg.persistent_keeper)
        host = cfg.advertise_host or cfg.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()

        tls = tls_settings(cfg)   # backups are reached with the server's own certificate and CA
        self.node = Node(self.arena, cfg.secret, self.stats, tls=tls.client_context() if tls.enabled else None,
                         dead_peer_timeout=cfg.replica_dead_peer_seconds)
        servicer = MemoryServerServicer(self.node, self)
        self._grpc = make_server(interceptors=[
            *rpc_tracing.setup("smb-server"), RpcMetrics(self.registry, "smb_server"),
            BearerAuth(cfg.token, exempt=TICKET_METHODS + HEALTH_METHODS)])
        memory_server_pb2_grpc.add_MemoryServerServicer_to_server(  # type: ignore[no-untyped-call]  # generated, untyped
            servicer, self._grpc)
        self._health = Health(self._grpc, ["smb.v1.MemoryServer"])
        port = add_port(self._grpc, format_hostport(cfg.listen_host, cfg.grpc_port), tls,
                        cfg.tls_client_auth)
        if port == 0:
            raise errors.InvalidArgument(f"cannot bind gRPC to {cfg.listen_host}:{cfg.grpc_port}")
        self._grpc.start()
        self.grpc_address = format_hostport(host, port)

        endpoints = []
        if "tcp" in cfg.transports:
            self.tcp = TcpPlane(self.node, cfg.listen_host, cfg.tcp_port,
                                self.stats.for_transport("tcp"), max_connections=cfg.tcp_connections_max,
                                frame_timeout=cfg.tcp_frame_timeout_seconds,
                                dead_peer_timeout=cfg.tcp_dead_peer_seconds, max_per_peer=cfg.tcp_connections_per_peer,
                                hello_timeout=cfg.tcp_hello_timeout_seconds,
                                max_unauthenticated=cfg.tcp_connections_unauthenticated,
                                scratch_bytes=cfg.tcp_scratch_bytes,
                                tls=tls.server_context(cfg.tls_client_auth) if tls.enabled else None)
            scheme = TLS_SCHEME if tls.enabled else "tcp"
            endpoints.append(f"{scheme}://{format_hostport(host, self.tcp.port)}")
        if "shm" in cfg.transports:
            self.shm = ShmPlane(self.node, self._socket_path(), self.stats.for_transport("shm"),
                                max_connections=cfg.shm_connections_max,
                                max_per_user=cfg.shm_connections_per_user,
                                max_unauthenticated=cfg.shm_connections_unauthenticated)
            endpoints.append(self.shm.endpoint)
        if "rdma" in cfg.transports:
            self.rdma = self._start_rdma(host)
            if self.rdma is not None:  # the gRPC service does the queue-pair exchange
                endpoints.append(f"rdma://{self.grpc_address}")
        unknown = set(cfg.transports) - {"tcp", "shm", "rdma"}
        if unknown:
            log.warning("transports %s are not available on this server (known: tcp, shm, rdma)",
                        ", ".join(sorted(unknown)))
        self.endpoints = endpoints
        log.info("memory server %s: gRPC %s, endpoints %s, capacity %d bytes", self.server_id,
                 self.grpc_address, " ".join(endpoints), self.arena.capacity)
        self._add_metrics()
        if cfg.metrics_port:
            metrics_host = cfg.metrics_host or cfg.listen_host
            self._metrics = MetricsServer(self.registry, metrics_host, cfg.metrics_port,
                                          healthy=lambda: self.status is Status.RUNNING)
            log.info("metrics on http://%s:%d/metrics", metrics_host, self._metrics.port)
        self._health.serving()

        self._controllers = Controllers(cfg.controller, lambda address: rpc.channel(address, tls),
                                        controller_pb2_grpc.ControllerStub)
        # register, heartbeat; one at once when a backup is newly marked failed (controller_link)
        self._link = ControllerLink(self.register, self.heartbeat, self._interval,
                                    Backoff(first=BACKOFF_FIRST, cap=BACKOFF_MAX, jitter=BACKOFF_JITTER),
                                    where=f"at {cfg.controller}", controllers=self._controllers)
        self.node.replication.on_failure = self._link.wake
        self._link.start()

    def _start_rdma(self, host: str) -> RdmaPlane | None:
        """The rdma plane, or None (logged) when this host has no usable RDMA device.

        The device is ``$SMB_RDMA_DEVICE`` or the first active one; its GID is the one of
        the advertised address when the device has it.
        """
        assert self.node is not None
        if not verbs.has_device():
            log.warning("rdma asked for, but this host has no RDMA device or no pyverbs; "
                        "serving tcp/shm only (run `smb doctor`)")
            return None
        try:
            prefer = socket.gethostbyname(host)
        except OSError:
            prefer = None
        try:
            return RdmaPlane(self.node, self.stats.for_transport("rdma"),
                             device=self.config.rdma_device or None, prefer_ipv4=prefer)
        except errors.SMBError as exc:
            log.warning("rdma plane not started: %s (run `smb doctor`)", exc)
            return None

    def stop(self, reason: str = "stopped") -> None:
        """Tell the controller, close the planes and gRPC, release every extent
        (idempotent). ``reason`` goes to the controller's log."""
        super().stop(reason)

    def _close(self, was: Status) -> None:
        was_running = was is Status.RUNNING
        reason = self.stop_reason or "stopped"
        if self._health is not None:
            self._health.shutting_down()
        if self._link is not None:
            self._link.stop(RPC_TIMEOUT + 1)
        if was_running and self.registered.is_set():
            self._unregister(reason)
        for plane in (self.tcp, self.shm, self.rdma, self.node):
            if plane is not None:
                plane.close()
        if self._grpc is not None:
            self._grpc.stop(GRPC_GRACE).wait()
        if self._controllers is not None:
            self._controllers.close()
        if self.arena is not None:
            held = len(self.arena)
            close_arena(self.arena, self.keeper)
            log.info("released %d extent(s)%s", held,
                     " (file-backed ones are kept in the data directory)" if self.config.data_dir else "")
        if self._metrics is not None:
            self._metrics.close()
        for path in self._tmp_dirs:
            shutil.rmtree(path, ignore_errors=True)

    def _unregister(self, reason: str) -> None:
        """Best effort: a controller that does not answer marks us down after the lease."""
        assert self._stub is not None
        request = controller_pb2.UnregisterServerRequest(server_id=self.server_id, reason=reason)
        try:
            rpc.call(self._stub.UnregisterServer, request, self._credential(), UNREGISTER_TIMEOUT,
                     errors.ControllerUnavailable)
            log.info("told the controller at %s that %s is stopping", self.config.controller,
                     self.server_id)
        except errors.SMBError as exc:
            log.warning("could not tell the controller at %s that this server stops (%s: %s); "
                        "it marks it down after its lease", self.config.controller,
                        type(exc).__name__, exc)

    def ready_message(self) -> str:
        return (f"serving {' '.join(self.endpoints)}; registering with "
                f"{self.config.controller}")

    def tick(self) -> None:
        """In run_forever: tell systemd once the controller has accepted this server."""
        if not self._announced and self.registered.is_set():
            sdnotify.notify(f"STATUS=serving {' '.join(self.endpoints)}; registered as "
                            f"{self.server_id} with {self.config.controller}")
            self._announced = True

    def wait_registered(self, timeout: float | None = None) -> bool:
        """True once the controller has accepted the registration (seconds to wait)."""
        return self.registered.wait(timeout)

    @property
    def metrics_port(self) -> int:
        """The bound port of the metrics endpoint; 0 when it is off."""
        return self._metrics.port if self._metrics is not None else 0

    def _add_metrics(self) -> None:
        assert self.arena is not None
        assert self.node is not None
        add_server_metrics(self.registry, self, self.arena, self.stats, self.node.replication)

    # -- state dir ----------------------------------------------------------------------
    def _mkdtemp(self) -> str:
        path = tempfile.mkdtemp(prefix="smb-server-")
        self._tmp_dirs.append(path)
        return path

    def _load_server_id(self) -> str:
        path = os.path.join(self._state_dir, "server_id")
        try:
            with open(path) as f:
                value = f.read().strip()
            if value:
                return value
        except FileNotFoundError:
            pass
        value = uuid.uuid4().hex[:12]
        write_atomic(path, value + "\n")
        return value

    def _socket_path(self) -> str:
        path = os.path.abspath(os.path.join(self._state_dir, SOCKET_NAME))
        if len(path.encode()) > MAX_UNIX_PATH:
            short = os.path.join(self._mkdtemp(), SOCKET_NAME)
            log.info("state dir path too long for a Unix socket; shm socket at %s", short)
            return short
        return path

    # -- controller ---------------------------------------------------------------------
    def _held(self) -> list[controller_pb2.HeldExtent]:
        assert self.arena is not None
        return [controller_pb2.HeldExtent(extent_id=h.extent_id, region_uid=h.region_uid,
                                          length=h.length, age_seconds=h.age_seconds)
                for h in self.arena.held()]

    @property
    def _stub(self) -> controller_pb2_grpc.ControllerStub | None:
        """The stub of the controller in use (the leader, once found)."""
        return None if self._controllers is None else self._controllers.stub

    def _credential(self) -> str:
        """What this server presents to the controller: its id, signed with the secret."""
        return server_credential(self.config.secret, self.server_id)

    def register(self) -> None:
        """One RegisterServer call; releases the orphans it names. Raises typed errors."""
        assert self._stub is not None
        request = controller_pb2.RegisterServerRequest(
            server_id=self.server_id, host_id=host_id(), grpc_address=self.grpc_address,
            endpoints=self.endpoints, capacity_bytes=self.config.capacity, extents=self._held())
        reply = rpc.call(self._stub.RegisterServer, request, self._credential(), RPC_TIMEOUT,
                         errors.ControllerUnavailable)
        if reply.server_id and reply.server_id != self.server_id:
            log.warning("controller calls this server %s (asked for %s)", reply.server_id, self.server_id)
            self.server_id = reply.server_id
        self.lease_seconds = reply.lease_seconds
        self._release_orphans(reply.orphan_extent_ids)
        if not self.registered.is_set():
            if self.config.ready_file:
                write_atomic(self.config.ready_file, json.dumps(
                    {"server_id": self.server_id, "grpc_address": self.grpc_address,
                     "endpoints": self.endpoints, "metrics_port": self.metrics_port}))
            self.registered.set()
        log.info("registered with the controller at %s as %s", self.config.controller, self.server_id)

    def heartbeat(self) -> None:
        """One Heartbeat call; releases the orphans it names. Raises typed errors."""
        assert self._stub is not None
        failed = [controller_pb2.FailedReplica(primary_extent_id=f.primary_extent_id, view=f.view,
                                               backup_extent_id=f.backup_extent_id, reason=f.reason[:200])
                  for f in (self.node.replication.failed_backups() if self.node is not None else [])]
        request = controller_pb2.HeartbeatRequest(server_id=self.server_id, extents=self._held(),
                                                  failed_replicas=failed)
        reply = rpc.call(self._stub.Heartbeat, request, self._credential(), RPC_TIMEOUT,
                         errors.ControllerUnavailable)
        self.lease_seconds = reply.lease_seconds
        self._release_orphans(reply.orphan_extent_ids)

    def _release_orphans(self, extent_ids: Any) -> None:
        assert self.arena is not None
        for extent_id in extent_ids:
            if self.arena.release(extent_id):
                log.info("released orphan extent %d (unknown to the controller)", extent_id)

    def _interval(self) -> float:
        interval = self.config.heartbeat_seconds
        if self.lease_seconds > 0:
            interval = min(interval, self.lease_seconds / 3)
        return max(0.05, interval)


def read_server_id(state_dir: str) -> str:
    """The id a memory server keeps in ``state_dir``; raises InvalidArgument (saying what
    to pass instead) when there is none."""
    if not state_dir:
        raise errors.InvalidArgument("cannot tell which memory server: set server_id or state_dir "
                                     "(--server-id, --state-dir, SMB_STATE_DIR or the config file)")
    path = os.path.join(state_dir, "server_id")
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read the server id from {path}: {exc.strerror} "
                                     "(has the server run with this state_dir? or pass --server-id)") from None
    if not value:
        raise errors.InvalidArgument(f"{path} is empty; pass --server-id")
    return value


def serve(config: ServerConfig) -> None:
    """Run a memory server until SIGTERM/SIGINT (the ``smb server`` command)."""
    from smb_server.runtime import logs
    server = MemoryServer(config)
    server.start()
    logs.set_context(server_id=server.server_id)
    server.run_forever()
