"""The controller daemon (``smb controller``): state + gRPC service + lease keeper.

Lifecycle (:class:`..daemon.Daemon`): ``starting`` (constructed, or inside
:meth:`Controller.start`), ``running``, ``closing``, ``closed``. ``with Controller(cfg)
as c:`` starts it and stops it on exit.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any

from smb_protocol import errors
from smb_protocol._proto.smb.v1 import controller_pb2_grpc
from smb_protocol.replicas import ASSIGNABLE
from smb_server.runtime import rpc_tracing
from smb_server.runtime.config import ConfigError, ControllerConfig
from smb_server.runtime.credentials import Credentials
from smb_server.runtime.daemon import Daemon, Status, write_atomic
from smb_server.runtime.grpc_util import RoleAuth, ServerInterceptor, add_port, make_server, tls_settings
from smb_server.runtime.health import HEALTH_METHODS, Health
from smb_server.runtime.metrics import MetricsServer, Registry
from smb_server.runtime.rpc_metrics import RpcMetrics

from .leader import Election, LeaderGate, LeaderLoop
from .records import FailedReplica
from .repair import REPAIR_INTERVAL, RepairManager, RepairMetrics
from .service import METHOD_ROLES, ControllerServicer
from .stores import open_state
from .stores.etcd.kv import is_etcd_url
from .stores.etcd.txn import Fence
from .stores.protocol import SERVER_STATES, Leadership, StateStore

log = logging.getLogger(__name__)

SHORT_CALL_WORKERS = 32    # handler threads for clients' short calls, beyond barrier waits
SERVER_WORKERS = 16        # handler threads only memory servers' calls (heartbeats) may use
STOP_GRACE = 2.0           # seconds in-flight calls get to finish on stop
STATUSES = tuple(s.value for s in Status)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class Controller(Daemon):
    """One controller process's worth of parts; owns the database, the gRPC server,
    the servicer, the lease thread and the metrics endpoint, all closed by :meth:`stop`.
    """

    kind = "controller"

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__()
        self.config = config
        self._grace = STOP_GRACE
        self.state: StateStore | None = None
        self.election: Election | None = None  # with an etcd store
        self._taken_over = False                # with etcd: this leader's take-over is done
        self._leader_loop: LeaderLoop | None = None
        self.servicer: ControllerServicer | None = None
        self._server: Any = None
        self._port = 0
        self._metrics: MetricsServer | None = None
        self.registry = Registry()
        self._health: Health | None = None
        self._stop_leases = threading.Event()
        self._lease_thread: threading.Thread | None = None
        self.repairer: RepairManager | None = None
        self._repair_wake = threading.Event()
        self._repair_thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` the gRPC service is bound to (the real port when listen says 0)."""
        if not self._port:
            raise errors.InvalidArgument("the controller is not started")
        host = self.config.listen.rpartition(":")[0]
        if host in _WILDCARD_HOSTS:
            host = socket.getfqdn()
        return f"{host}:{self._port}"

    def start(self) -> Controller:
        """Open the database, serve gRPC, start the lease keeper, write the ready file."""
        super().start()
        log.info("controller serving at %s (store %s, lease %.1f s)", self.address,
                 self.store, self.config.lease_seconds)
        return self

    @property
    def store(self) -> str:
        """Where the state lives: ``store`` when set, else the SQLite file ``db_path``."""
        return self.config.store or self.config.db_path

    def leading(self) -> bool:
        """True when this controller serves: always with SQLite, as leader with etcd once
        its take-over is done (until then its lease loop must not mark down the servers
        the take-over gives a fresh lease, and calls wait for the take-over anyway)."""
        return self.election is None or (self.election.leading() and self._taken_over)

    def ready_message(self) -> str:
        return f"serving at {self.address}"

    def _start(self) -> None:
        cfg = self.config
        credentials = check_credentials(cfg)
        replicated = is_etcd_url(self.store)
        if not replicated and cfg.db_path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(cfg.db_path)), exist_ok=True)
        # with etcd, only the leader cleans up and writes (after it won: LeaderLoop)
        self.state = open_state(self.store, cfg.lease_seconds, cfg.orphan_grace_seconds,
                                recover=not replicated)
        leadership = self.state.leadership
        if leadership is None:
            self.state.expire_leases()  # servers silent since the last run are down until they call
        else:
            leadership.stand_by()       # no write before this controller wins the election
        self.servicer = ControllerServicer(self.state, cfg.secret, cfg.token, cfg.ticket_ttl_seconds,
                                           max_barrier_waits=cfg.barrier_waits_max)
        self.servicer.memservers.tls = tls_settings(cfg)   # the controller calls memory servers
        # barrier waits, then clients' short calls, then memory servers: a flood of client
        # calls is refused ("busy") before it takes the threads heartbeats need
        client_slots = cfg.barrier_waits_max + SHORT_CALL_WORKERS
        interceptors: list[ServerInterceptor] = [
            *rpc_tracing.setup("smb-controller"), RpcMetrics(self.registry, "smb_controller"),
            RoleAuth(credentials, METHOD_ROLES, exempt=HEALTH_METHODS, client_slots=client_slots)]
        if leadership is not None:  # standbys refuse, naming the leader
            interceptors.append(LeaderGate("smb.v1.Controller", self.leading, self._describe_leader))
        self._server = make_server(max_workers=client_slots + SERVER_WORKERS, interceptors=interceptors)
        controller_pb2_grpc.add_ControllerServicer_to_server(  # type: ignore[no-untyped-call]  # generated, untyped
            self.servicer, self._server)
        self._health = Health(self._server, ["smb.v1.Controller"])
        try:
            self._port = add_port(self._server, cfg.listen, tls_settings(cfg), cfg.tls_client_auth)
        except RuntimeError as exc:
            raise errors.Unavailable(f"cannot listen on {cfg.listen}: {exc} "
                                     "(address in use, or not an address of this host?)") from None
        if not self._port:
            raise errors.Unavailable(f"cannot listen on {cfg.listen} (address in use?)")
        self._server.start()
        if leadership is not None:
            self._start_election(leadership)
        self.repairer = RepairManager(self.state, self.servicer.memservers,
                                      metrics=RepairMetrics(self.registry))
        self.servicer.on_failed_replicas = self._failed_replicas
        self.servicer.repairs = self.repairer
        self.repairer.wake = self._repair_wake.set
        self.servicer.wake_repairs = self._repair_wake.set
        self._repair_thread = threading.Thread(target=self._repair_loop, name="controller-repair",
                                               daemon=True)
        self._repair_thread.start()
        self._lease_thread = threading.Thread(target=self._lease_loop, name="controller-leases",
                                              daemon=True)
        self._lease_thread.start()
        self._add_state_metrics()
        if cfg.metrics_port:
            host = cfg.metrics_host or cfg.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
            self._metrics = MetricsServer(self.registry, host, cfg.metrics_port,
                                          healthy=lambda: self.status == "running")
            log.info("metrics on http://%s:%d/metrics", host, self._metrics.port)
        self._health.serving()
        if cfg.ready_file:
            write_atomic(cfg.ready_file, json.dumps({"address": self.address}))

    def _start_election(self, leadership: Leadership) -> None:
        election = self.election = leadership.election(self.address, self.config.leader_lease_seconds)

        if self.servicer is not None:  # barriers' generations outlive a leader
            self.servicer.barriers.store = leadership

        def on_lead(fence: Fence) -> None:
            if self.servicer is not None:  # memory servers refuse older epochs' admin tickets
                self.servicer.memservers.epoch = fence.epoch
                self.servicer.barriers.reset("a new leader took over; retry")
            self._taken_over = False
            leadership.take_over(fence)
            self._taken_over = True

        def on_lose() -> None:
            self._taken_over = False
            leadership.step_down()
            if self.servicer is not None:  # its barrier waiters retry at the new leader
                self.servicer.barriers.reset("this controller no longer leads; retry at the leader")

        self._leader_loop = LeaderLoop(election, on_lead, on_lose)
        self._leader_loop.start()

    def _describe_leader(self) -> str:
        """The leader as the election's watch last showed it (a refusal reads no etcd)."""
        return self.election.describe() if self.election is not None else f"at {self.address}"

    def _lease_loop(self) -> None:
        assert self.state is not None and self.servicer is not None
        interval = max(0.05, self.config.lease_seconds / 4)
        while not self._stop_leases.wait(interval):
            if not self.leading():
                continue
            try:
                if self.state.expire_leases():
                    self._repair_wake.set()              # replica sets to fence now
                self.servicer.creator.delete_expired()   # regions whose owner stopped renewing
            except errors.ControllerUnavailable as exc:
                log.info("expiring leases: %s", exc)
            except Exception:
                log.exception("expiring leases")

    def _failed_replicas(self, reports: list[FailedReplica]) -> None:
        """A heartbeat reported backups its server's primaries cannot reach: the repair
        thread drops them at once (their mutations wait for it)."""
        if self.repairer is not None and self.leading():
            self.repairer.report(reports)
            self._repair_wake.set()

    def _repair_loop(self) -> None:
        """Repair passes (:mod:`.repair`) every ``REPAIR_INTERVAL`` seconds, at once when
        the lease loop marks a server down, while this controller leads. A thread of its
        own: a pass waits for quick configure calls, never for a sync (those run on the
        repair manager's pool), and never holds up lease expiry."""
        repairer = self.repairer
        assert repairer is not None
        led = False
        while not self._stop_leases.is_set():
            self._repair_wake.wait(REPAIR_INTERVAL)
            self._repair_wake.clear()
            if self._stop_leases.is_set():
                break
            leading = self.leading()
            if leading != led:
                repairer.reset()     # a new leader pushes every slot's settings again
                led = leading
            if not leading:
                continue
            try:
                repairer.run_pass()
            except errors.ControllerUnavailable as exc:
                log.info("repairing replica sets: %s", exc)
            except Exception:
                log.exception("repairing replica sets")

    @property
    def metrics_port(self) -> int:
        """The bound port of the metrics endpoint; 0 when it is off."""
        return self._metrics.port if self._metrics is not None else 0

    def _add_state_metrics(self) -> None:
        """Gauges read from the database at scrape time."""
        state = self.state
        assert state is not None
        reg = self.registry
        reg.gauge("smb_controller_servers", "Memory servers by state", ["state"],
                  fn=lambda: _count_by(s.state for s in state.list_servers()))
        reg.gauge("smb_controller_server_info", "One per memory server, with its state and address",
                  ["server_id", "state", "address"],
                  fn=lambda: [((s.server_id, s.state, s.grpc_address), 1) for s in state.list_servers()])
        reg.gauge("smb_controller_capacity_bytes", "Capacity of each memory server, bytes", ["server_id"],
                  fn=lambda: [((s.server_id,), s.capacity) for s in state.list_servers()])
        reg.gauge("smb_controller_used_bytes", "Bytes placed on each memory server", ["server_id"],
                  fn=lambda: [((s.server_id,), s.used) for s in state.list_servers()])
        reg.gauge("smb_controller_extents", "Extents placed on each memory server", ["server_id"],
                  fn=lambda: [((s.server_id,), s.extents) for s in state.list_servers()])
        reg.gauge("smb_controller_regions", "Regions by state", ["state"],
                  fn=lambda: _count_by((r.state for r in state.list_regions()), ("ready", "degraded", "lost")))
        reg.gauge("smb_controller_lost_extents", "Extents of regions whose memory server came back "
                  "without them, per server", ["server_id"],
                  fn=lambda: _count_by((e.server_id for r in state.list_regions()
                                               for e in r.extents if e.lost), ()))
        reg.gauge("smb_controller_replica_copies", "Copies of replicated regions' slots by role "
                  "(primary, backup, syncing, stale)", ["role"],
                  fn=lambda: _count_by((e.role for r in state.list_regions() if r.replicas > 1
                                        for e in r.extents), tuple(ASSIGNABLE)))
        reg.gauge("smb_controller_region_bytes", "Bytes of all regions together",
                  fn=lambda: [((), sum(r.size for r in state.list_regions()))])

    def stop(self, reason: str = "stopped", *, grace: float = STOP_GRACE) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds) and close everything.

        Barrier waiters get ControllerUnavailable. Idempotent.
        """
        self._grace = grace
        super().stop(reason)

    def _close(self, was: Status) -> None:
        if self._health is not None:
            self._health.shutting_down()
        self._stop_leases.set()
        self._repair_wake.set()
        if self.servicer is not None:
            self.servicer.barriers.close()
        if self._server is not None:
            self._server.stop(self._grace if was is Status.RUNNING else 0).wait()
        if self._lease_thread is not None:
            self._lease_thread.join()
        if self._repair_thread is not None:
            self._repair_thread.join()
        if self.repairer is not None:
            self.repairer.close(wait=False)   # closing the channels below ends its syncs
        if self._leader_loop is not None:
            self._leader_loop.stop()
        if self._metrics is not None:
            self._metrics.close()
        if self.servicer is not None:
            self.servicer.close()
        if self.state is not None:
            self.state.close()
        if self.config.ready_file and self._port:
            try:
                os.unlink(self.config.ready_file)
            except OSError:
                pass


def check_credentials(cfg: ControllerConfig) -> Credentials | None:
    """The credentials the controller checks; None when ``insecure`` turns checks off.

    Raises ConfigError (saying what to set) when the client token or the shared secret
    is missing and ``insecure`` is not set.
    """
    if cfg.insecure:
        log.warning("INSECURE: authentication is off (insecure = true); anyone who reaches %s "
                    "may register servers, drain them and read or delete every region", cfg.listen)
        if not cfg.secret:
            log.warning("no ticket secret configured: tickets are signed with an empty key")
        return None
    missing = [what for what, value in (("a client token (token: SMB_TOKEN or the config file)",
                                         cfg.token),
                                        ("the shared secret (secret_file or SMB_SECRET)", cfg.secret))
               if not value]
    if missing:
        raise ConfigError(f"the controller needs {' and '.join(missing)} to authenticate callers; "
                          "for a trusted test setup only, pass --insecure (insecure = true)")
    admin_token = ""
    if cfg.admin_token_file:
        try:
            with open(cfg.admin_token_file) as f:
                admin_token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"admin token file {cfg.admin_token_file}: {exc.strerror}") from None
        if not admin_token:
            raise ConfigError(f"admin token file {cfg.admin_token_file} is empty")
    return Credentials(cfg.token, cfg.secret, admin_token)


def _count_by(values: Any, always: tuple[str, ...] = SERVER_STATES) -> list[tuple[tuple[str], int]]:
    """``[((value,), count)]`` for every value seen and every one of ``always``."""
    counts = dict.fromkeys(always, 0)
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return [((k,), n) for k, n in sorted(counts.items())]


def serve(config: ControllerConfig) -> None:
    """Run a controller until SIGTERM/SIGINT (the ``smb controller`` command)."""
    Controller(config).run_forever()
