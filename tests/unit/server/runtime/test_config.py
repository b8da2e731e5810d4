"""Configuration: precedence (defaults < file < SMB_* < flags), validation of types and
values with errors naming the source and the key, the shipped example files, and
``smb check-config``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smb_server.commands.cli import build_parser
from smb_server.commands.flags import setting_flags as _flags
from smb_server.runtime.config import ConfigError, ControllerConfig, ServerConfig, load, render_example, settings
from smb_server.testing import wait_until

ROOT = Path(__file__).resolve().parents[4]


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


@pytest.mark.parametrize("kind, text, key", [
    ("server", "heartbeat_seconds = \"fast\"", "heartbeat_seconds"),
    ("server", "transports = [\"tcp\", \"udp\"]", "transports"),
    ("controller", "lease_seconds = 0", "lease_seconds"),
    ("controller", "metrics_port = 70000", "metrics_port"),
    ("server", "cpus = \"4096\"", "cpus"),
])
def test_daemon_refuses_bad_config_and_does_not_start(tmp_path, kind, text, key):
    f = tmp_path / f"{kind}.toml"
    ready = tmp_path / "ready"
    f.write_text(f"{text}\nready_file = \"{ready}\"\n")
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", kind, "--config", str(f)],
                         capture_output=True, text=True, timeout=60, env=_env(SMB_SECRET="00" * 32))
    assert out.returncode == 2
    assert f"{f}: key '{key}'" in out.stderr and "configuration error" in out.stderr
    assert not ready.exists()                   # it never started serving


@pytest.mark.parametrize("text, message", [
    # a wrong type, an unknown key, no TOML
    ("capacity = true", "key 'capacity' must be a size"),
    ("grpc_port = \"x\"", "key 'grpc_port' must be an integer"),
    ("transports = \"tcp\"", "key 'transports' must be a list of strings"),
    ("capacty = 5", "unknown key 'capacty'"),
    ("capacity = ", "not valid TOML"),
    # a value out of range
    ("grpc_port = 70000", "key 'grpc_port' must be from 0 to 65535, got 70000"),
    ("tcp_port = -1", "key 'tcp_port' must be from 0 to 65535"),
    ("transports = [\"tcp\", \"udp\"]", "key 'transports' must be each one of tcp, shm, rdma, got 'udp'"),
    ("log_level = \"LOUD\"", "key 'log_level' must be one of DEBUG, INFO, WARNING, ERROR"),
    ("log_format = \"xml\"", "key 'log_format' must be one of text, json"),
    ("heartbeat_seconds = 0", "key 'heartbeat_seconds' must be above 0"),
    ("tcp_connections_max = 0", "key 'tcp_connections_max' must be at least 1"),
    ("capacity = \"-5G\"", "key 'capacity' must be a size"),
    ("[server]\ncapacity = \"1G\"", "unknown key 'server'"),
    ("cpus = \"one\"", "key 'cpus' must be CPU cores such as \"2\" or \"0-3,8\", on this host: 'one' is not a core"),
    ("cpus = \"3-1\"", "'3-1' is not a range of cores"),
    ("cpus = \"0,4096\"", "core 4096 does not exist here"),
    ("cpus = 2", "key 'cpus' must be CPU cores"),
])
def test_a_bad_file_value_names_file_and_key(tmp_path, text, message):
    f = tmp_path / "server.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load(ServerConfig, str(f), env={})
    assert str(info.value).startswith(f"{f}: ") and message in str(info.value)


def test_environment_and_flag_values_are_checked_too():
    with pytest.raises(ConfigError, match="environment variable SMB_GRPC_PORT: key 'grpc_port' must be from 0"):
        load(ServerConfig, None, env={"SMB_GRPC_PORT": "99999"})
    with pytest.raises(ConfigError, match="environment variable SMB_TRANSPORTS: .* got 'ib'"):
        load(ServerConfig, None, env={"SMB_TRANSPORTS": "tcp,ib"})
    with pytest.raises(ConfigError, match="--lease-seconds: key 'lease_seconds' must be above 0"):
        load(ControllerConfig, None, env={}, flags={"lease_seconds": -1.0})
    with pytest.raises(ConfigError, match="--metrics-port: key 'metrics_port'"):
        load(ControllerConfig, None, env={}, flags={"metrics_port": 65536})


def test_log_level_is_case_insensitive(tmp_path):
    f = tmp_path / "controller.toml"
    f.write_text('log_level = "debug"\nlog_format = "json"\n')
    cfg = load(ControllerConfig, str(f), env={"SMB_LOG_LEVEL": "warning"})
    assert (cfg.log_level, cfg.log_format) == ("WARNING", "json")
    assert load(ControllerConfig, str(f), env={}).log_level == "DEBUG"


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}: cannot read the configuration file"):
        load(ServerConfig, str(tmp_path), env={})         # a directory


def _env(**extra: str) -> dict[str, str]:
    """This environment without SMB_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(extra)
    return env


def test_daemon_applies_file_then_environment_then_flags(tmp_path):
    """A real controller: the file sets the log format and the listen address, the
    environment overrides the database path and the listen address, a flag overrides
    the listen address again and gives the ready file."""
    ready, db_env, log = tmp_path / "ready", tmp_path / "from-env.db", tmp_path / "log"
    f = tmp_path / "controller.toml"
    f.write_text(f'log_format = "json"\nlisten = "127.0.0.1:1"\ndb_path = "{tmp_path}/from-file.db"\n')
    env = _env(SMB_SECRET="ab" * 32, SMB_TOKEN="t0ken", SMB_DB_PATH=str(db_env), SMB_LISTEN="127.0.0.1:2")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "smb_server.commands.cli", "controller", "--config", str(f),
                                 "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(ready, proc)
        address = json.loads(ready.read_text())["address"]
        assert address.startswith("127.0.0.1:") and address not in ("127.0.0.1:1", "127.0.0.1:2")
        assert db_env.exists() and not (tmp_path / "from-file.db").exists()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]   # the file's log format
    assert records and all(r["daemon"] == "controller" and r["level"] for r in records)
    assert any(r["msg"].startswith("controller serving at") for r in records)


def _wait_for(path, proc, timeout: float = 30.0) -> None:
    def there() -> bool:
        assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
        return path.exists()
    wait_until(there, f"{path} to appear", timeout)


def test_cli_flags_are_only_those_given():
    args = build_parser().parse_args(["server", "--capacity", "2G", "--grpc-port", "7710"])
    assert _flags(args, ServerConfig) == {"capacity": "2G", "grpc_port": "7710"}
    args = build_parser().parse_args(["--log-level", "debug", "--log-format", "json", "controller"])
    assert _flags(args, ControllerConfig) == {"log_level": "debug", "log_format": "json"}


def test_check_config_command(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("11" * 32)
    good = tmp_path / "server.toml"
    good.write_text(f'capacity = "2G"\ntoken = "s3cr3t"\nsecret_file = "{secret}"\n')
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "check-config", "server", str(good)],
                         capture_output=True, text=True, timeout=60, env=_env(SMB_CAPACITY="9G"))
    assert out.returncode == 0, out.stderr
    assert "capacity = 2147483648" in out.stdout          # the environment counts only with --env
    assert "s3cr3t" not in out.stdout and "token = '(set)'" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(f'secret_file = "{tmp_path}/missing"\n')
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "check-config", "server", str(bad)],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 2 and "secret file" in out.stderr and "missing" in out.stderr


@pytest.mark.parametrize("kind, cls", [("controller", ControllerConfig), ("server", ServerConfig)])
def test_shipped_example_files_load(kind, cls):
    cfg = load(cls, str(ROOT / "deploy" / "config" / f"{kind}.toml"), env={})
    assert cfg == load(cls, None, env={})              # every key commented out: the defaults


@pytest.mark.parametrize("cls", [ControllerConfig, ServerConfig])
def test_operations_guide_documents_every_key(cls):
    guide = (ROOT / "docs" / "operations.md").read_text()
    for f in settings(cls):
        assert f"| `{f.name}` | `SMB_{f.name.upper()}` |" in guide, f"docs/operations.md lacks {f.name}"
