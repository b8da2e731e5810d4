"""`smb up` and `smb down` as an operator runs them (real processes): the token kept
across restarts, metrics that `smb status --metrics` shows, stopping through the pid
file; and the README's daemon command lines, run as written."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from smb_client import Client
from smb_server.testing import wait_until
from tests.integration.daemons import Daemon, free_port, smb

ROOT = Path(__file__).resolve().parents[3]
UP_WAIT = 60.0   # seconds `smb up` gets to start its daemons (a loaded host)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(extra)
    return env


class Up:
    """One `smb up` process with its pid file in ``tmp``; its output in ``log``."""

    def __init__(self, tmp: Path, env: dict[str, str], *args: str) -> None:
        self.pid_file = tmp / "up.pid"
        self.log = tmp / "up.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "smb_server.commands.cli", "up", "--servers", "1", "--capacity", "64M",
                 "--port", "0", "--pid-file", str(self.pid_file), *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> dict:
        def ready() -> dict | None:
            assert self.proc.poll() is None, f"smb up exited with {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                return json.loads(self.pid_file.read_text())
            except (OSError, ValueError):
                return None
        return wait_until(ready, "smb up ready", UP_WAIT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_up_keeps_smb_token_serves_metrics_and_down_stops_it(tmp_path):
    up = Up(tmp_path, _env(SMB_TOKEN="kept-token-1"), "--metrics", "--workdir", str(tmp_path / "w"))
    try:
        state = up.wait_ready()
        assert state["pid"] == up.proc.pid
        assert json.loads((tmp_path / "w" / "up.json").read_text()) == state
        assert "export SMB_TOKEN=kept-token-1" in up.log.read_text()
        with Client(state["address"], "kept-token-1", transport="tcp") as c:   # the token it was given
            r = c.create_region("updown/r", 1 << 20)
            r.write(0, np.ones(1 << 18, np.float32))
            r.close()
        env = _env(SMB_CONTROLLER=state["address"], SMB_TOKEN="kept-token-1")
        status = smb("status", "--metrics", env=env)
        assert status.returncode == 0, status.stderr
        assert "operation latency (server side" in status.stdout
        assert re.search(r"^\S+\s+write\s+tcp\s+[1-9]", status.stdout, re.M), status.stdout
        down = smb("down", "--pid-file", str(up.pid_file), env=_env())
        assert down.returncode == 0, down.stderr
        assert f"stopped the local cluster at {state['address']}" in down.stdout
        assert up.proc.wait(UP_WAIT) == 0
        assert not up.pid_file.exists() and not (tmp_path / "w" / "up.json").exists()
        assert "stopping local cluster" in up.log.read_text()
    finally:
        up.kill()


def test_up_env_file_keeps_the_token_across_restarts_and_down_finds_the_workdir(tmp_path):
    env_file = tmp_path / "smb.env"
    tokens = []
    for start in range(2):
        workdir = tmp_path / f"w{start}"
        up = Up(tmp_path, _env(), "--env-file", str(env_file), "--workdir", str(workdir))
        try:
            state = up.wait_ready()
            text = env_file.read_text()
            assert oct(env_file.stat().st_mode & 0o777) == "0o600"
            assert f"export SMB_CONTROLLER={state['address']}" in text
            tokens.append(re.search(r"^export SMB_TOKEN=(\S+)$", text, re.M).group(1))
            with Client(state["address"], tokens[-1]) as c:
                assert len(c.list_servers()) == 1
            down = smb("down", "--workdir", str(workdir), env=_env())
            assert down.returncode == 0, down.stderr
            assert up.proc.wait(UP_WAIT) == 0
        finally:
            up.kill()
    assert tokens[0] == tokens[1]


def test_up_is_ready_only_once_the_env_file_is_written(tmp_path):
    """The pid file is `smb up`'s ready signal: whoever sees it must find the env file
    written. The pid file is a FIFO here, so `smb up` blocks in opening it until this
    test opens it to read: at that moment the env file must be complete, whatever the
    timing (written before, not after)."""
    env_file = tmp_path / "smb.env"
    pid_fifo = tmp_path / "up.pid"
    os.mkfifo(pid_fifo)
    up = Up(tmp_path, _env(SMB_TOKEN="fifo-token"), "--env-file", str(env_file),
            "--workdir", str(tmp_path / "w"))
    try:
        with open(pid_fifo) as fifo:            # returns once `smb up` opened it to write
            assert env_file.exists(), "smb up reported ready before writing its env file"
            text = env_file.read_text()
            state = json.loads(fifo.read())
        pid_fifo.unlink()                       # `smb up` removes its pid file at exit: none to open
        assert "export SMB_TOKEN=fifo-token" in text
        assert f"export SMB_CONTROLLER={state['address']}" in text
        up.proc.terminate()                     # as Ctrl-C: `smb up` stops its daemons
        assert up.proc.wait(UP_WAIT) == 0
    finally:
        pid_fifo.unlink(missing_ok=True)
        if up.proc.poll() is None:              # stop it as Ctrl-C does, so its daemons stop too
            up.proc.terminate()
            try:
                up.proc.wait(UP_WAIT)
            except subprocess.TimeoutExpired:
                up.kill()


def test_down_without_a_cluster_names_the_file_and_the_fix(tmp_path):
    out = smb("down", "--pid-file", str(tmp_path / "none.pid"), env=_env())
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "ClusterError" in out.stderr and str(tmp_path / "none.pid") in out.stderr
    assert "--workdir" in out.stderr


def test_down_removes_a_stale_pid_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / "stale.pid"
    stale.write_text(json.dumps({"pid": int(done.stdout), "address": "127.0.0.1:1", "workdir": ""}))
    out = smb("down", "--pid-file", str(stale), env=_env())
    assert out.returncode == 0, out.stderr
    assert "not running" in out.stdout and not stale.exists()


def test_status_metrics_without_metrics_says_how_to_get_them(cluster):
    env = _env(SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    out = smb("status", "--metrics", env=env)
    assert out.returncode == 0, out.stderr
    assert "no memory server serves /metrics" in out.stdout and "smb up --metrics" in out.stdout
    assert "SERVER  OP" not in out.stdout          # no empty latency table


def readme_daemon_lines() -> list[str]:
    """The shell block of README.md that starts the real daemons."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n((?:(?!```).)*?smb controller (?:(?!```).)*)```", text, re.S)
    assert block, "README.md has no block with the smb controller command line"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_daemon_command_lines_run_as_written(tmp_path):
    """The README's daemon lines, on temporary paths and loopback: the controller and
    the memory server come up, and a client with the exported token sees the server."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "var").mkdir()
    port = free_port()
    lines = [line.replace("/etc/smb/", f"{tmp_path}/etc/").replace("/var/lib/smb/", f"{tmp_path}/var/")
             .replace("0.0.0.0:7700", f"127.0.0.1:{port}").replace("HOST:7700", f"127.0.0.1:{port}")
             .replace("0.0.0.0", "127.0.0.1").replace("<ip>", "127.0.0.1").replace("64G", "64M")
             for line in readme_daemon_lines()]
    controller = next(line for line in lines if line.startswith("smb controller "))
    server = next(line for line in lines if line.startswith("smb server "))
    setup = [line for line in lines if not line.startswith("smb ")]
    env = _env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    prepared = subprocess.run(["bash", "-e", "-c", "\n".join(setup) + '\nprintf %s "$SMB_TOKEN"'], env=env,
                              capture_output=True, text=True, timeout=60)
    assert prepared.returncode == 0, prepared.stderr
    env["SMB_TOKEN"] = token = prepared.stdout
    assert token
    daemons = []
    try:
        for name, line in (("controller", controller), ("server", server)):
            args = line.split()[1:]
            daemons.append(Daemon(tmp_path, name, args, env))
            daemons[-1].wait_ready()
        with Client(f"127.0.0.1:{port}", token) as c:
            wait_until(lambda: [s for s in c.list_servers() if s.state == "up"], "the server registered")
    finally:
        for d in reversed(daemons):
            d.stop()
