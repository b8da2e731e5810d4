"""The `smb` command's wiring: every documented subcommand exists."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from smb_protocol.rdma import verbs
from smb_server.commands.cli import build_parser
from smb_server.commands.flags import GLOBAL_SETTINGS
from smb_server.commands.flags import setting_flags as _flags
from smb_server.runtime.config import ConfigError, ControllerConfig, ServerConfig, load, settings


def test_documented_subcommands_exist():
    parser = build_parser()
    for argv in (["doctor"], ["check-config", "server", "f.toml"], ["server", "drain"],
                 ["server", "undrain"], ["status", "--metrics", "--json"], ["server", "drain", "--server-id", "abc"],
                 ["train", "--scheme", "sync"], ["up"], ["region", "ls"]):
        assert callable(parser.parse_args(argv).fn)
    with pytest.raises(SystemExit):
        parser.parse_args(["server", "evacuate"])


@pytest.mark.skipif(bool(verbs.device_names()), reason="this host has an RDMA device")
def test_smb_doctor_runs_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "doctor"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "[FAIL] no RDMA device on this host" in out.stdout and "fix:" in out.stdout


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_every_flag_has_help():
    parser = build_parser()
    missing = [f"{name} {a.option_strings or a.dest}" for name, sub in [("smb", parser), *_subparsers(parser).items()]
               for a in sub._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert missing == []


@pytest.mark.parametrize(("command", "cls"), [("controller", ControllerConfig), ("server", ServerConfig)])
def test_daemon_flags_are_made_from_the_settings(command, cls):
    sub = _subparsers(build_parser())[command]
    flags = {a.dest: a for a in sub._actions if a.option_strings}
    for f in settings(cls):
        if f.name in GLOBAL_SETTINGS:
            continue
        action = flags.pop(f.name)
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert f.metadata["doc"] in action.help and f"SMB_{f.name.upper()}" in action.help
        assert action.default is None   # only flags given override the file
    # besides the settings: the file, and what `smb server drain --evacuate` follows the moves with
    assert set(flags) == {"help", "config"} | ({"evacuate", "timeout", "quiet"} if command == "server" else set())


def test_flag_aliases_and_checked_values():
    parser = build_parser()
    args = parser.parse_args(["controller", "--db", "x.db", "--lease", "2", "--ticket-ttl", "60"])
    assert _flags(args, ControllerConfig) == {"db_path": "x.db", "lease_seconds": "2", "ticket_ttl_seconds": "60"}
    cfg = load(ControllerConfig, flags=_flags(args, ControllerConfig), env={}, with_secret=False)
    assert (cfg.db_path, cfg.lease_seconds, cfg.ticket_ttl_seconds) == ("x.db", 2.0, 60.0)
    args = parser.parse_args(["server", "--grpc-port", "70000"])
    with pytest.raises(ConfigError, match="--grpc-port"):
        load(ServerConfig, flags=_flags(args, ServerConfig), env={}, with_secret=False)


def test_each_flag_name_means_one_thing():
    parser = build_parser()
    assert parser.parse_args(["up", "--memory-servers", "3"]).memory_servers == 3
    assert parser.parse_args(["up", "--servers", "3"]).memory_servers == 3
    assert parser.parse_args(["region", "create", "r", "1M", "--num-servers", "2"]).num_servers == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["region", "create", "r", "1M", "--servers", "2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["drain", "abc"])   # one drain command: smb server drain


def test_version():
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"smb (soft-memory-box) {metadata.version('soft-memory-box')}"


@pytest.mark.parametrize(("command", "cls", "title"), [("controller", ControllerConfig, "### Controller keys"),
                                                        ("server", ServerConfig, "### Memory server keys")])
def test_operations_guide_tables_match_the_flags(command, cls, title):
    """docs/operations.md lists, per key, its variable and a flag the command accepts."""
    text = (Path(__file__).resolve().parents[4] / "docs" / "operations.md").read_text()
    table = text.split(title, 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    sub = _subparsers(build_parser())[command]
    options = {a.dest: a.option_strings for a in sub._actions}
    assert [r[0] for r in rows] == [f.name for f in settings(cls)]
    for key, variable, flag, *_ in rows:
        assert variable == f"SMB_{key.upper()}"
        if key not in GLOBAL_SETTINGS:
            assert flag in options[key], (key, flag)
