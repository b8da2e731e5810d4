"""Several real controller processes on one etcd store, and memory servers beside them,
for the failover and fencing tests and the benchmarks that fail a leader over.
Everything listens on 127.0.0.1."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from smb_client import Client
from smb_protocol import errors

from ..commands.local_cluster import wait_for_json
from ..controller.stores.etcd.kv import EtcdKV, is_etcd_url, parse_url
from ..runtime.config import new_secret, new_token
from .harness import wait_until

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds


class ControllerGroup:
    """``count`` controllers sharing ``store`` (an ``etcd://`` URL; a SQLite path for one
    controller); owns their processes (killed at :meth:`stop`). ``extra_args`` go to
    every controller. As a context manager: started on entry, stopped on exit."""

    def __init__(self, workdir: Path, store: str, count: int = 2, leader_lease: int = 2,
                 server_lease: float = 3.0, extra_args: tuple[str, ...] = ()) -> None:
        self.extra_args = list(extra_args)
        self.workdir = workdir
        self.store = store
        self.leader_lease = leader_lease
        self.server_lease = server_lease
        self.token = new_token()
        self.secret_file = workdir / "secret"
        self.secret_file.write_text(new_secret().hex())
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.addresses = [""] * count
        self.servers: list[subprocess.Popen[bytes]] = []
        self.kv: EtcdKV | None = None
        if is_etcd_url(store):
            endpoints, self.prefix = parse_url(store)
            self.kv = EtcdKV(endpoints)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as logf:
            return subprocess.Popen([sys.executable, "-m", "smb_server.commands.cli", "--log-level", "INFO", *args],
                                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, SMB_TOKEN=self.token), start_new_session=True)

    def start_controller(self, i: int) -> None:
        ready = self.workdir / f"controller-{i}.ready"
        ready.unlink(missing_ok=True)
        port = self.addresses[i].rpartition(":")[2] if self.addresses[i] else "0"
        self.procs[i] = proc = self._spawn(f"controller-{i}", [
            "controller", "--listen", f"127.0.0.1:{port}", "--store", self.store,
            "--leader-lease-seconds", str(self.leader_lease), "--lease", str(self.server_lease),
            "--secret-file", str(self.secret_file), "--ready-file", str(ready), *self.extra_args])
        self.addresses[i] = wait_for_json(ready, START_TIMEOUT, proc)["address"]

    def start(self) -> ControllerGroup:
        for i in range(len(self.procs)):
            self.start_controller(i)
        return self

    def __enter__(self) -> ControllerGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()                  # the controllers that did start
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_server(self, capacity: str = "256M") -> None:
        i = len(self.servers)
        state = self.workdir / f"server-{i}"
        state.mkdir()
        proc = self._spawn(f"server-{i}", [
            "server", "--controller", ",".join(self.addresses), "--capacity", capacity,
            "--state-dir", str(state), "--secret-file", str(self.secret_file),
            "--ready-file", str(state / "ready"), "--transports", "tcp", "--heartbeat", "0.3"])
        self.servers.append(proc)
        wait_for_json(state / "ready", START_TIMEOUT, proc)

    def client(self, i: int | None = None, reconnect_timeout: float = 0.0) -> Client:
        """A client of controller ``i``, or of the whole list (following the leader)."""
        address = ",".join(self.addresses) if i is None else self.addresses[i]
        return Client(address, self.token, reconnect_timeout=reconnect_timeout)

    def leader_record(self) -> dict[str, object] | None:
        """The leader key as etcd holds it (address and epoch), None while there is none."""
        assert self.kv is not None, "a SQLite store has no leader"
        item = self.kv.get(f"{self.prefix}/leader")
        return None if item is None else dict(item.json())

    def answers(self, i: int) -> bool:
        """True when controller ``i`` serves calls (it leads)."""
        try:
            with self.client(i) as c:
                c.list_servers()
            return True
        except errors.ControllerUnavailable:
            return False

    def wait_leader(self, timeout: float = START_TIMEOUT, among: tuple[int, ...] | None = None) -> int:
        """The index of the controller that leads (polls until one does; TimeoutError
        after ``timeout`` seconds)."""
        candidates = among if among is not None else tuple(range(len(self.procs)))

        def leader() -> tuple[int] | None:   # a 1-tuple: index 0 is an answer too
            record = self.leader_record()
            if record is not None:
                for i in candidates:
                    if self.addresses[i] == record["address"] and self.answers(i):
                        return (i,)
            return None
        return wait_until(leader, f"a leader among controllers {candidates}", timeout)[0]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait()
            self.procs[i] = None

    def stop(self) -> None:
        for proc in [*self.servers, *self.procs]:
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in [*self.servers, *self.procs]:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.kv is not None:
            self.kv.close()
