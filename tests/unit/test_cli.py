"""The `smb` command's wiring: every documented subcommand exists."""
from __future__ import annotations

import subprocess
import sys

import pytest

from smb_client import verbs
from smb_server.cli import build_parser


def test_documented_subcommands_exist():
    parser = build_parser()
    for argv in (["doctor"], ["check-config", "server", "f.toml"], ["server", "drain"],
                 ["server", "undrain"], ["status", "--metrics", "--json"], ["drain", "abc"]):
        assert callable(parser.parse_args(argv).fn)
    with pytest.raises(SystemExit):
        parser.parse_args(["server", "evacuate"])


@pytest.mark.skipif(bool(verbs.device_names()), reason="this host has an RDMA device")
def test_smb_doctor_runs_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "smb_server.cli", "doctor"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "[FAIL] no RDMA device on this host" in out.stdout and "fix:" in out.stdout
