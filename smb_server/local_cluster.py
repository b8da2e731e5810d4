"""A controller and N memory servers on this host, each its own process, on loopback.

Used by ``smb up``, the demo and the integration tests. Every daemon binds port 0 (or
the port asked for) and reports its address through a ready file; :meth:`start`
returns once every memory server has registered.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from smb_client import Client
from smb_client.units import parse_size

from .config import new_secret, new_token

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds


class ClusterError(RuntimeError):
    pass


def wait_for_json(path: Path, timeout: float, proc: subprocess.Popen | None = None,
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


class LocalCluster:
    """Owns its processes and its work directory (a temporary one unless given)."""

    def __init__(self, servers: int = 2, capacity: int | str = "1G", *, workdir: str | None = None,
                 controller_port: int = 0, token: str | None = None, transports: str = "tcp,shm",
                 lease_seconds: float = 3.0, heartbeat_seconds: float = 0.5,
                 orphan_grace_seconds: float = 5.0, persistent: bool = False,
                 env: dict[str, str] | None = None, log_level: str = "INFO") -> None:
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
        self.controller: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen | None] = []
        self.address = ""
        self.state = "new"

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "LocalCluster":
        self.state = "starting"
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.secret_file.exists():
            self.secret_file.write_text(new_secret().hex())
            self.secret_file.chmod(0o600)
        try:
            self.start_controller()
            self.servers = [None] * self.num_servers
            for i in range(self.num_servers):
                self.start_server(i, wait=False)
            self.wait_servers(self.num_servers)
        except BaseException:
            self.stop()
            raise
        self.state = "running"
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every daemon, SIGKILL those still alive after ``timeout`` seconds."""
        self.state = "closing"
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
        self.state = "closed"

    # -- processes -----------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        logf = open(self.workdir / f"{name}.log", "ab")
        cmd = [sys.executable, "-m", "smb_server.cli", "--log-level", self.log_level, *args]
        env = dict(self.env, SMB_TOKEN=self.token)
        try:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            logf.close()

    def _wait_file(self, path: Path, proc: subprocess.Popen, what: str) -> dict[str, Any]:
        try:
            return wait_for_json(path, START_TIMEOUT, proc)
        except ChildProcessError:
            raise ClusterError(f"{what} exited with {proc.returncode}; see {self.log_path(what)}:\n"
                               + self.log_tail(what)) from None
        except TimeoutError:
            raise ClusterError(f"{what} not ready after {START_TIMEOUT} s; see {self.log_path(what)}") from None

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
            "--lease", str(self.lease_seconds), "--orphan-grace", str(self.orphan_grace_seconds)])
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
                "--heartbeat", str(self.heartbeat_seconds)]
        if self.persistent:
            args += ["--data-dir", str(state / "data")]
        self.servers[i] = self._spawn(name, args)
        if wait:
            self._wait_file(ready, self.servers[i], name)

    def wait_servers(self, count: int, timeout: float = START_TIMEOUT) -> None:
        """Wait until ``count`` memory servers are registered and up."""
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
        return json.loads((self.workdir / f"server-{i}" / "ready").read_text())["server_id"]

    def client(self, **kwargs: Any) -> Client:
        return Client(self.address, self.token, **kwargs)

    def describe(self) -> str:
        return (f"export SMB_CONTROLLER={self.address}\n"
                f"export SMB_TOKEN={self.token}\n")
