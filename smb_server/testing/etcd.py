"""A real etcd member for tests and benchmarks: the distribution's ``etcd`` binary on
loopback ports with a temporary data directory, stopped (and its directory removed) by
:meth:`EtcdServer.stop`."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid

log = logging.getLogger(__name__)

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
START_TIMEOUT = 30.0  # seconds
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


class EtcdNotInstalled(RuntimeError):
    """There is no ``etcd`` binary here (``make deps`` installs etcd-server)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on 127.0.0.1, started by the constructor (which returns once it
    answers its health check, or raises :class:`EtcdNotInstalled` or RuntimeError); owns
    its process and data directory until :meth:`stop`."""

    def __init__(self) -> None:
        if not os.path.exists(ETCD):
            raise EtcdNotInstalled("etcd is not installed (make deps installs etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="smb-etcd-")
        self.port = _free_port()
        peer = _free_port()
        self.log = open(os.path.join(self.dir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            [ETCD, "--name", "test", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", f"http://127.0.0.1:{self.port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not start; see {self.dir}/etcd.log")
            time.sleep(0.1)
        log.info("etcd serves on %s", self.endpoint)

    def _healthy(self) -> bool:
        try:
            with _DIRECT.open(f"http://127.0.0.1:{self.port}/health", timeout=1) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        """An ``etcd://`` store URL on this member, under ``prefix`` (default: a fresh one)."""
        return f"etcd://{self.endpoint}/{prefix or 'smb-' + uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
