"""What a newcomer meets first at the `smb` command: options the docs name exist,
help that shows what the subcommand takes, and output cut short by a pipe."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from smb_server.commands import cli


def test_train_takes_max_restarts_and_hands_it_to_the_launcher(monkeypatch):
    """docs/training.md: `smb train --max-restarts 1` passes the option to torchrun."""
    seen: list[list[str]] = []
    digits = pytest.importorskip("smb_train.digits")
    monkeypatch.setattr(digits, "main", lambda argv: seen.append(list(argv)) or 0)
    monkeypatch.delenv("SMB_CONTROLLER", raising=False)
    assert cli.main(["train", "--scheme", "seasgd", "--max-restarts", "1"]) == 0
    argv = seen[0]
    assert argv[argv.index("--max-restarts") + 1] == "1"
    assert digits.build_parser().parse_args(argv).max_restarts == 1
    assert cli.main(["train", "--scheme", "sync"]) == 0
    assert "--max-restarts" not in seen[1]


@pytest.mark.parametrize("action", ["drain", "undrain", "remove"])
def test_server_admin_help_shows_only_what_the_action_takes(action):
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "server", action, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"smb server {action}" in text
    for flag in ("--server-id", "--config", "--controller", "--state-dir"):
        assert flag in text, flag
    for daemon_only in ("--capacity", "--grpc-port", "--data-dir", "--huge-pages"):
        assert daemon_only not in text, daemon_only
    assert ("--evacuate" in text) == (action == "drain")
    assert "SMB_ADMIN_TOKEN" in text


def test_server_help_still_lists_the_daemon_settings():
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "server", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--capacity" in out.stdout and "--grpc-port" in out.stdout


def test_output_cut_short_by_a_pipe_ends_quietly():
    """`smb ... | head`: the reader goes away; the command ends without a traceback."""
    script = textwrap.dedent("""
        import sys
        from smb_server.commands import cli
        def flood(args):
            for i in range(200000):
                print("region", i)
            return 0
        cli.cmd_status = flood   # what `smb status` runs, without a cluster
        sys.exit(cli.main(["status"]))
    """)
    proc = subprocess.run(f"{sys.executable} -c '{script}' | head -n 2", shell=True, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.splitlines() == ["region 0", "region 1"]
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
