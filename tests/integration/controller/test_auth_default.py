"""Authentication is on unless explicitly turned off, and no credential shows in argv."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import smb_client
from smb_protocol import errors

WAIT = 30.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(extra)
    return env


def _controller(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "smb_server.commands.cli", "controller", "--listen",
                             "127.0.0.1:0", "--db", str(tmp_path / "c.db"),
                             "--ready-file", str(tmp_path / "ready"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("extra", [{"SMB_SECRET": "5a" * 32}, {"SMB_TOKEN": "t0ken"}, {}])
def test_controller_without_credentials_refuses_to_start(tmp_path, extra):
    proc = _controller(tmp_path, env=_env(**extra))
    out, _ = proc.communicate(timeout=WAIT)
    assert proc.returncode == 2, out
    assert "--insecure" in out
    assert not (tmp_path / "ready").exists()


def test_insecure_must_be_asked_for_and_says_so(tmp_path):
    proc = _controller(tmp_path, "--insecure", env=_env())
    try:
        deadline = time.monotonic() + WAIT
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        address = json.loads((tmp_path / "ready").read_text())["address"]
        with smb_client.connect(address, token="") as c:
            assert c.list_servers() == []
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=WAIT)
    assert "INSECURE" in out


def test_no_credential_on_any_command_line(cluster):
    secrets = [cluster.token, cluster.admin_token, cluster.secret_file.read_text().strip()]
    procs = [cluster.controller, *cluster.servers]
    for p in procs:
        assert p is not None
        argv = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode()
        assert not [s for s in secrets if s in argv], argv
    # the client token works, and it is not a server or admin credential
    with cluster.client() as c:
        with pytest.raises(errors.PermissionDenied, match="needs the admin role"):
            c.drain_server(cluster.server_id(0))


def test_smb_train_passes_the_token_in_the_environment(tmp_path):
    probe = ("import sys, os\n"
             "from smb_train import digits\n"
             "digits.main = lambda argv: print('ARGV', argv, 'ENV', os.environ.get('SMB_TOKEN')) or 0\n"
             "from smb_server.commands import cli\n"
             "sys.exit(cli.main(['train', '--controller', '127.0.0.1:1', '--scheme', 'sync']))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=WAIT,
                         env=_env(SMB_TOKEN="s3cret-token"))
    assert out.returncode == 0, out.stderr
    argv_part, _, env_part = out.stdout.partition("ENV")
    assert "s3cret-token" not in argv_part and "s3cret-token" in env_part
    refused = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "train", "--token", "x"],
                             capture_output=True, text=True, timeout=WAIT, env=_env())
    assert refused.returncode == 2
