"""A controller and N memory servers on this host, each its own process, on loopback.

Used by ``smb up``, the demo and the integration tests. Every daemon binds port 0 (or
the port asked for) and reports its address through a ready file; :meth:`start`
returns once every memory server has registered. Lifecycle: :class:`.daemon.Daemon`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from smb_client import Client
from smb_protocol import errors
from smb_protocol.tls import TLSConfig
from smb_protocol.units import parse_size
from smb_server.runtime.certs import ClusterCerts, make_cluster_certs
from smb_server.runtime.config import new_secret, new_token
from smb_server.runtime.credentials import admin_credential
from smb_server.runtime.daemon import Daemon, Status

log = logging.getLogger(__name__)


def start_timeout() -> float:
    """Seconds a daemon of a local cluster has to become ready: ``$SMB_START_TIMEOUT``
    (for slow hosts, such as the emulated Soft-RoCE VM) or :data:`START_TIMEOUT`."""
    try:
        return max(1.0, float(os.environ.get("SMB_START_TIMEOUT", "") or START_TIMEOUT))
    except ValueError:
        return START_TIMEOUT

START_TIMEOUT = 30.0  # seconds a daemon has to become ready (default of $SMB_START_TIMEOUT)
STOP_TIMEOUT = 10.0   # seconds daemons get after SIGTERM before SIGKILL
LOOPBACK = "127.0.0.1"


class ClusterError(errors.SMBError, RuntimeError):
    """A local cluster could not start; the message says why and what to do."""


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise ClusterError (naming the port and what to do) when ``port`` cannot be bound
    on ``host``; port 0 is always free. The test bind uses SO_REUSEADDR, as the
    controller's listener does: connections of a stopped cluster left in TIME_WAIT do not
    hold the port, a listener does."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ClusterError(
                    f"port {port} on {host} is already in use (another `smb up` or controller?); "
                    f"stop what listens there, or pick another port with --port (0: any free port)"
                ) from None
            raise ClusterError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another "
                               "port with --port (0: any free port)") from None


def wait_for_json(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None,
                  poll: float = 0.05) -> Any:
    """Poll until ``path`` holds a whole JSON document and return it. Raises
    ChildProcessError when ``proc`` (the writer) exits first, TimeoutError after
    ``timeout`` seconds; callers turn these into their own errors, with the logs."""
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass  # being written
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"exited with {proc.returncode} before writing {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} within {timeout:.0f} s")
        time.sleep(poll)


class LocalCluster(Daemon):
    """Owns its processes and its work directory (a temporary one unless given, removed
    at :meth:`stop`)."""

    kind = "local cluster"

    def __init__(self, servers: int = 2, capacity: int | str = "1G", *, workdir: str | None = None,
                 controller_port: int = 0, token: str | None = None, transports: str = "tcp,shm",
                 lease_seconds: float = 3.0, heartbeat_seconds: float = 0.5,
                 orphan_grace_seconds: float = 5.0, persistent: bool = False,
                 env: dict[str, str] | None = None, log_level: str = "INFO",
                 tls: bool = False, tls_client_auth: bool = False, metrics: bool = False) -> None:
        super().__init__()
        self.num_servers = servers
        self.capacity = parse_size(capacity)
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="smb-local-"))
        self.controller_port = controller_port
        self.token = new_token() if token is None else token
        self.transports = transports
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.orphan_grace_seconds = orphan_grace_seconds
        self.persistent = persistent
        self.env = dict(os.environ, **(env or {}))
        self.log_level = log_level
        self.secret_file = self.workdir / "secret"
        # a throw-away CA and certificates in workdir/tls (made at start); client_auth:
        # the daemons also refuse clients without a certificate of that CA
        self.tls = tls or tls_client_auth
        self.tls_client_auth = tls_client_auth
        self.certs: ClusterCerts | None = None
        # every daemon serves Prometheus /metrics on a free loopback port of its own
        self.metrics = metrics
        self.controller: subprocess.Popen[bytes] | None = None
        self.servers: list[subprocess.Popen[bytes] | None] = []
        self.address = ""
        self._stop_timeout = STOP_TIMEOUT

    # -- lifecycle -----------------------------------------------------------------
    @property
    def state(self) -> str:
        """The status as a string (kept for callers of the earlier attribute)."""
        return self.status.value

    def start(self) -> LocalCluster:
        """Start the controller and the memory servers; returns once all registered.
        Raises ClusterError (after stopping what did start)."""
        return super().start()

    def ready_message(self) -> str:
        return f"controller at {self.address}, {self.num_servers} memory servers"

    def _start(self) -> None:
        check_port_free(self.controller_port)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.secret_file.exists():
            self.secret_file.write_text(new_secret().hex())
            self.secret_file.chmod(0o600)
        if self.tls and self.certs is None:
            self.certs = make_cluster_certs(str(self.workdir / "tls"))
        self.start_controller()
        self.servers = [None] * self.num_servers
        for i in range(self.num_servers):
            self.start_server(i, wait=False)
        self.wait_servers(self.num_servers)

    def stop(self, reason: str = "stopped", timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM every daemon, SIGKILL those still alive after ``timeout`` seconds."""
        self._stop_timeout = timeout
        super().stop(reason)

    def _close(self, was: Status) -> None:
        timeout = self._stop_timeout
        procs = [p for p in [*self.servers, self.controller] if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- processes -----------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        logf = open(self.workdir / f"{name}.log", "ab")
        cmd = [sys.executable, "-m", "smb_server.commands.cli", "--log-level", self.log_level, *args]
        # the daemons' TLS comes from the flags of _tls_args, never from a shell's SMB_TLS_*
        # (a client's files there would be taken for the daemons' own)
        env = {k: v for k, v in self.env.items() if not k.startswith("SMB_TLS_")}
        env["SMB_TOKEN"] = self.token
        try:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            logf.close()

    def _tls_args(self) -> list[str]:
        """The TLS flags of a daemon of this cluster (none without TLS)."""
        if self.certs is None:
            return []
        daemon = self.certs.daemon()
        args = ["--tls-ca", daemon.ca, "--tls-cert", daemon.cert, "--tls-key", daemon.key]
        return args + ["--tls-client-auth", "true"] if self.tls_client_auth else args

    def _metrics_args(self) -> list[str]:
        """The metrics flags of a daemon of this cluster: a free loopback port when
        :attr:`metrics` is on (a daemon that then cannot bind it says so in its log)."""
        if not self.metrics:
            return []
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
        return ["--metrics-port", str(port), "--metrics-host", LOOPBACK]

    def _wait_file(self, path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = wait_for_json(path, start_timeout(), proc)
            return doc
        except ChildProcessError:
            tail = self.log_tail(what)
            bind = [line for line in tail.splitlines() if "cannot listen on" in line]
            if bind:  # the port was taken after check_port_free
                detail = bind[-1].partition("cannot listen on")[2].strip()
                raise ClusterError(f"{what} cannot listen on {detail}; pick another port with "
                                   "--port (0: any free port)") from None
            raise ClusterError(f"{what} exited with {proc.returncode}; {self._log_hint(what)}:\n"
                               + tail) from None
        except TimeoutError:
            raise ClusterError(f"{what} not ready after {start_timeout():g} s (SMB_START_TIMEOUT); "
                               f"{self._log_hint(what)}:\n"
                               + self.log_tail(what)) from None

    def _log_hint(self, name: str) -> str:
        """Where the log is; a temporary work directory goes when the cluster stops, so
        then only its tail (printed below) remains."""
        if self._own_workdir:
            return "the end of its log (removed with the temporary work directory)"
        return f"see {self.log_path(name)}"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start_controller(self) -> None:
        ready = self.workdir / "controller.ready"
        ready.unlink(missing_ok=True)
        port = self.controller_port
        if self.address:  # a restart keeps the address clients know
            port = int(self.address.rpartition(":")[2])
        self.controller = self._spawn("controller", [
            "controller", "--listen", f"127.0.0.1:{port}",
            "--db", str(self.workdir / "controller.db"),
            "--secret-file", str(self.secret_file), "--ready-file", str(ready),
            "--lease", str(self.lease_seconds), "--orphan-grace", str(self.orphan_grace_seconds),
            *self._tls_args(), *self._metrics_args()])
        self.address = self._wait_file(ready, self.controller, "controller")["address"]

    def start_server(self, i: int, wait: bool = True) -> None:
        name = f"server-{i}"
        state = self.workdir / name
        state.mkdir(exist_ok=True)
        ready = state / "ready"
        ready.unlink(missing_ok=True)
        args = ["server", "--controller", self.address, "--capacity", str(self.capacity),
                "--state-dir", str(state), "--secret-file", str(self.secret_file),
                "--ready-file", str(ready), "--transports", self.transports,
                "--heartbeat", str(self.heartbeat_seconds), *self._tls_args(), *self._metrics_args()]
        if self.persistent:
            args += ["--data-dir", str(state / "data")]
        proc = self._spawn(name, args)
        self.servers[i] = proc
        if wait:
            self._wait_file(ready, proc, name)

    def add_server(self) -> int:
        """Start one more memory server (a machine joining the pool); returns its index."""
        self.servers.append(None)
        self.num_servers += 1
        self.start_server(len(self.servers) - 1)
        return len(self.servers) - 1

    def wait_servers(self, count: int, timeout: float | None = None) -> None:
        """Wait until ``count`` memory servers are registered and up (``timeout``
        seconds, default :func:`start_timeout`)."""
        timeout = start_timeout() if timeout is None else timeout
        for i, p in enumerate(self.servers):
            if p is not None:
                self._wait_file(self.workdir / f"server-{i}" / "ready", p, f"server-{i}")
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                up = [s for s in c.list_servers() if s.state == "up"]
                if len(up) >= count:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(f"only {len(up)} of {count} memory servers registered")
                time.sleep(0.05)

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.servers[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(10)

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.send_signal(sig)
            self.controller.wait(10)

    def server_pid(self, i: int) -> int:
        p = self.servers[i]
        assert p is not None
        return p.pid

    def server_id(self, i: int) -> str:
        return str(json.loads((self.workdir / f"server-{i}" / "ready").read_text())["server_id"])

    def server_metrics_port(self, i: int) -> int:
        """The port of memory server ``i``'s ``/metrics`` on loopback (with ``metrics``)."""
        return int(json.loads((self.workdir / f"server-{i}" / "ready").read_text())["metrics_port"])

    @property
    def admin_token(self) -> str:
        """The admin credential of this cluster (derived from its secret file)."""
        return admin_credential(bytes.fromhex(self.secret_file.read_text().strip()))

    def client(self, **kwargs: Any) -> Client:
        """A client with the client token (regions, data, barriers), and with TLS the
        cluster's client certificate (without, TLS off whatever SMB_TLS_* says)."""
        kwargs.setdefault("tls", self._client_tls())
        return Client(self.address, self.token, **kwargs)

    def admin_client(self, **kwargs: Any) -> Client:
        """A client with the admin credential (drain, undrain, remove servers)."""
        kwargs.setdefault("tls", self._client_tls())
        return Client(self.address, self.admin_token, **kwargs)

    def _client_tls(self) -> TLSConfig:
        return self.certs.client() if self.certs is not None else TLSConfig()

    def describe(self) -> str:
        """Shell lines that point clients (and, with the admin line, operators) here."""
        tls = ""
        if self.certs is not None:
            client = self.certs.client()
            tls = (f"export SMB_TLS_CA={client.ca}\n"
                   f"export SMB_TLS_CERT={client.cert}\n"
                   f"export SMB_TLS_KEY={client.key}\n")
        return (f"export SMB_CONTROLLER={self.address}\n"
                f"export SMB_TOKEN={self.token}\n{tls}"
                f"# operators only (drain, undrain, remove servers):\n"
                f"export SMB_ADMIN_TOKEN={self.admin_token}\n")
