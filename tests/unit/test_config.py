"""Configuration precedence and validation; the example files and systemd units."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smb_server.config import ConfigError, ControllerConfig, ServerConfig, load, render_example, settings
from smb_server.metrics import Registry

ROOT = Path(__file__).resolve().parents[2]


def test_precedence_defaults_file_env_flags(tmp_path):
    f = tmp_path / "server.toml"
    f.write_text('capacity = "2G"\ngrpc_port = 7710\ncontroller = "10.0.0.1:7700"\ntransports = ["tcp"]\n')
    cfg = load(ServerConfig, str(f), env={})
    assert (cfg.capacity, cfg.grpc_port, cfg.controller, cfg.transports) == (2 << 30, 7710, "10.0.0.1:7700", ["tcp"])
    assert cfg.heartbeat_seconds == 1.0                                # default kept
    cfg = load(ServerConfig, str(f), env={"SMB_GRPC_PORT": "7720", "SMB_TRANSPORTS": "tcp,rdma"})
    assert (cfg.grpc_port, cfg.transports, cfg.capacity) == (7720, ["tcp", "rdma"], 2 << 30)
    cfg = load(ServerConfig, str(f), env={"SMB_GRPC_PORT": "7720"}, flags={"grpc_port": 7730, "tcp_port": None})
    assert cfg.grpc_port == 7730 and cfg.tcp_port == 0


def test_default_path_only_when_present(tmp_path):
    cfg = load(ControllerConfig, None, default_path=str(tmp_path / "missing.toml"), env={})
    assert cfg.listen == "127.0.0.1:7700"
    with pytest.raises(ConfigError, match="no such configuration file"):
        load(ControllerConfig, str(tmp_path / "missing.toml"), env={})


@pytest.mark.parametrize("text, message", [
    ("capacity = true", "key 'capacity' must be a size"),
    ("grpc_port = \"x\"", "key 'grpc_port' must be an integer"),
    ("transports = \"tcp\"", "key 'transports' must be a list of strings"),
    ("capacty = 5", "unknown key 'capacty'"),
    ("capacity = ", "not valid TOML"),
])
def test_bad_file_names_file_key_and_type(tmp_path, text, message):
    f = tmp_path / "server.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load(ServerConfig, str(f), env={})
    assert message in str(info.value) and str(f) in str(info.value)


def test_bad_environment_value():
    with pytest.raises(ConfigError, match="SMB_HEARTBEAT_SECONDS"):
        load(ServerConfig, None, env={"SMB_HEARTBEAT_SECONDS": "often"})
    with pytest.raises(ConfigError, match="SMB_SECRET"):
        load(ServerConfig, None, env={"SMB_SECRET": "not-hex"})


def test_secret_from_file(tmp_path):
    s = tmp_path / "secret"
    s.write_text("00ff" * 8)
    assert load(ControllerConfig, None, env={}, flags={"secret_file": str(s)}).secret == bytes.fromhex("00ff" * 8)
    with pytest.raises(ConfigError, match="secret file"):
        load(ControllerConfig, None, env={}, flags={"secret_file": str(tmp_path / "nope")})


@pytest.mark.parametrize("cls, name", [(ControllerConfig, "controller.toml"), (ServerConfig, "server.toml")])
def test_example_files_document_every_key(cls, name):
    shipped = (ROOT / "deploy" / "config" / name).read_text()
    for f in settings(cls):
        assert f"{f.name} =" in shipped, f"{name} lacks {f.name}"
    assert shipped.strip().endswith(render_example(cls).strip())


def test_daemon_refuses_bad_config_and_does_not_start(tmp_path):
    f = tmp_path / "server.toml"
    f.write_text("heartbeat_seconds = \"fast\"\n")
    out = subprocess.run([sys.executable, "-m", "smb_server.cli", "server", "--config", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "heartbeat_seconds" in out.stderr and str(f) in out.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path):
    # the units run /opt/smb/.venv/bin/smb; point them at this checkout's smb instead
    smb = str(Path(sys.executable).parent / "smb")
    assert os.access(smb, os.X_OK)
    paths = []
    for unit in (ROOT / "deploy" / "systemd").glob("*.service"):
        name = unit.name.replace("@.service", "@0.service")
        (tmp_path / name).write_text(unit.read_text().replace("/opt/smb/.venv/bin/smb", smb))
        paths.append(str(tmp_path / name))
    assert len(paths) == 2
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths],
                         capture_output=True, text=True, timeout=60)
    problems = [l for l in out.stderr.splitlines() if "smb-" in l]
    assert out.returncode == 0 and not problems, out.stderr


def test_metrics_exposition():
    reg = Registry()
    ops = reg.counter("smb_ops_total", "operations", ["op"])
    ops.inc(op="read")
    ops.inc(2, op="read")
    lat = reg.histogram("smb_op_seconds", "latency", ["op"], buckets=(0.001, 0.01))
    lat.observe(0.005, op="read")
    lat.observe(5.0, op="read")
    text = reg.render()
    assert 'smb_ops_total{op="read"} 3' in text
    assert 'smb_op_seconds_bucket{op="read",le="0.001"} 0' in text
    assert 'smb_op_seconds_bucket{op="read",le="0.01"} 1' in text
    assert 'smb_op_seconds_bucket{op="read",le="+Inf"} 2' in text
    assert 'smb_op_seconds_count{op="read"} 2' in text
    with pytest.raises(ValueError):
        ops.inc(transport="tcp")
