"""Real `smb controller` and `smb server` processes for the integration tests, and
what the tests ask of them: readiness, the `smb` command line, Prometheus metrics,
a region's state."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from smb_server.runtime.metrics import parse
from smb_server.testing import WAIT, wait_until  # WAIT: seconds a daemon gets to come up or go away


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smb(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smb_server.commands.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


class Daemon:
    """One `smb controller` or `smb server` process of a test; output in ``log``."""

    def __init__(self, workdir: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.log = workdir / f"{name}.log"
        self.ready = workdir / f"{name}.ready"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "smb_server.commands.cli", *args,
                                          "--ready-file", str(self.ready)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)

    def wait_ready(self) -> dict:
        def ready() -> dict | None:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log.read_text()}"
            return json.loads(self.ready.read_text()) if self.ready.exists() else None
        return wait_until(ready, f"{self.log.name} ready")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(tmp_path: Path, env: dict[str, str], daemons: list[Daemon], name: str,
                 *args: str, extra_env: dict[str, str] | None = None) -> Daemon:
    d = Daemon(tmp_path, name, ["server", "--state-dir", str(tmp_path / name), "--heartbeat", "0.2",
                                *args], dict(env, **(extra_env or {})))
    daemons.append(d)
    return d


def scrape(port: int) -> dict:
    """The samples of the metrics endpoint on ``port``: {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse(reply.read().decode())}


def wait_state(c, name: str, state: str, timeout: float = 20.0) -> None:
    """Wait until client ``c`` lists region ``name`` in ``state`` (``timeout`` seconds)."""
    seen: dict[str, str] = {}

    def reached() -> bool:
        seen.update((r.name, r.state) for r in c.list_regions())
        return seen.get(name) == state
    wait_until(reached, f"region {name} {state} (last seen {seen.get(name)})", timeout, pause=0.1)
