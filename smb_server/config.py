"""Settings of the controller and the memory server.

Precedence, lowest to highest: built-in defaults, the TOML file
(``/etc/smb/controller.toml`` or ``/etc/smb/server.toml``, or ``--config PATH``),
``SMB_*`` environment variables (``SMB_`` + the key in upper case, e.g.
``SMB_CAPACITY``), then command-line flags. Every key is documented in the field's
``doc`` below and in ``deploy/config/*.toml``. A file with an unknown key or a value of
the wrong type is refused with an error naming the file, the key and the expected type,
so a daemon never starts half-configured.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from smb_client.errors import InvalidArgument
from smb_client.units import parse_size

DEFAULT_CONTROLLER_FILE = "/etc/smb/controller.toml"
DEFAULT_SERVER_FILE = "/etc/smb/server.toml"


class ConfigError(InvalidArgument):
    """A configuration file, variable or flag with a bad key or value."""


def _f(default: Any, doc: str, kind: str = "") -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc, "kind": kind})
    return field(default=default, metadata={"doc": doc, "kind": kind})


@dataclass
class ControllerConfig:
    listen: str = _f("127.0.0.1:7700", "host:port of the gRPC service (port 0: any free port)")
    db_path: str = _f("smb-controller.db", "SQLite database file (WAL mode)")
    token: str = _f("", "bearer token clients and servers must present; empty disables auth")
    secret_file: str = _f("", "file holding the HMAC ticket secret (hex), shared with memory servers")
    lease_seconds: float = _f(5.0, "a memory server silent this long is marked down")
    orphan_grace_seconds: float = _f(30.0, "extents unknown to the controller are freed after this age")
    ticket_ttl_seconds: float = _f(3600.0, "lifetime of region tickets")
    metrics_port: int = _f(0, "Prometheus /metrics HTTP port (0: off)")
    ready_file: str = _f("", "written with the bound address once serving")
    log_level: str = _f("INFO", "DEBUG, INFO, WARNING or ERROR")
    secret: bytes = field(default=b"", metadata={"internal": True})


@dataclass
class ServerConfig:
    controller: str = _f("127.0.0.1:7700", "host:port of the controller")
    listen_host: str = _f("127.0.0.1", "address of the gRPC service and the TCP data plane")
    advertise_host: str = _f("", "address clients use to reach this server (default listen_host)")
    grpc_port: int = _f(0, "gRPC port (0: any free port)")
    tcp_port: int = _f(0, "TCP data-plane port (0: any free port)")
    capacity: int = _f(1 << 30, "bytes of RAM this server may hand out (e.g. 64G)", "size")
    token: str = _f("", "bearer token of the cluster")
    secret_file: str = _f("", "file holding the HMAC ticket secret (hex), shared with the controller")
    server_id: str = _f("", "stable id (default: generated once and kept in state_dir)")
    state_dir: str = _f("", "where the server keeps its id and its shm socket")
    data_dir: str = _f("", "directory for file-backed (persistent) extents; empty: memory only")
    transports: list[str] = _f(["tcp", "shm"], "data planes to offer: tcp, shm, rdma")
    rdma_device: str = _f("", "RDMA device to use (default: the first one)")
    heartbeat_seconds: float = _f(1.0, "seconds between heartbeats to the controller")
    tcp_connections_max: int = _f(1024, "most concurrent TCP data-plane connections")
    metrics_port: int = _f(0, "Prometheus /metrics HTTP port (0: off)")
    ready_file: str = _f("", "written with the server id once registered")
    log_level: str = _f("INFO", "DEBUG, INFO, WARNING or ERROR")
    secret: bytes = field(default=b"", metadata={"internal": True})


C = TypeVar("C", ControllerConfig, ServerConfig)

_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "list[str]": "a list of strings", "size": "a size such as 4096 or \"16G\""}


def settings(cls: type) -> list[dataclasses.Field]:
    """The configurable fields of a config class."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _convert(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind = f.metadata.get("kind") or str(f.type)
    try:
        if kind == "size":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError
            return parse_size(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "list[str]" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    except (TypeError, InvalidArgument):
        pass
    raise ConfigError(f"{where}: key {f.name!r} must be {_TYPE_NAMES.get(kind, kind)}, got {value!r}")


def _from_text(f: dataclasses.Field, text: str, where: str) -> Any:
    kind = f.metadata.get("kind") or str(f.type)
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return text.lower() in ("1", "true", "yes")
        if kind == "list[str]":
            return [t.strip() for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{where}: must be {_TYPE_NAMES.get(kind, kind)}, got {text!r}") from None
    return _convert(f, text, where)


def load(cls: type[C], path: str | None = None, *, default_path: str = "",
         env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> C:
    """Build a config: defaults < TOML file < ``SMB_*`` environment < flags.

    ``path`` names the file (it must exist); without it ``default_path`` is read when
    present. ``flags`` holds only the options given on the command line (None = not
    given). Raises :class:`ConfigError` naming the file or variable, key and type.
    """
    env = os.environ if env is None else env
    fields = {f.name: f for f in settings(cls)}
    values: dict[str, Any] = {}
    file = path or (default_path if default_path and os.path.exists(default_path) else "")
    if file:
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{file}: no such configuration file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        for key, value in data.items():
            if key not in fields:
                raise ConfigError(f"{file}: unknown key {key!r}; known keys: {', '.join(sorted(fields))}")
            values[key] = _convert(fields[key], value, file)
    for name, f in fields.items():
        var = "SMB_" + name.upper()
        if var in env and env[var] != "":
            values[name] = _from_text(f, env[var], f"environment variable {var}")
    for name, value in (flags or {}).items():
        if value is None or name not in fields:
            continue
        where = "--" + name.replace("_", "-")
        values[name] = _from_text(fields[name], value, where) if isinstance(value, str) else \
            _convert(fields[name], value, where)
    cfg = cls(**values)
    cfg.secret = load_secret(cfg.secret_file, env=env)
    return cfg


def load_secret(path: str = "", env: Mapping[str, str] | None = None) -> bytes:
    """The cluster HMAC secret from a file (hex or raw bytes) or ``$SMB_SECRET`` (hex)."""
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"secret file {path}: {exc.strerror}") from None
        try:
            return bytes.fromhex(data.decode())
        except (ValueError, UnicodeDecodeError):
            return data
    value = (os.environ if env is None else env).get("SMB_SECRET", "")
    try:
        return bytes.fromhex(value) if value else b""
    except ValueError:
        raise ConfigError("environment variable SMB_SECRET must be hex") from None


def render_example(cls: type) -> str:
    """A TOML file listing every key with its documentation and default."""
    lines = []
    for f in settings(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"# {f.metadata['doc']}")
        if isinstance(default, str):
            lines.append(f"# {f.name} = \"{default}\"")
        elif isinstance(default, bool):
            lines.append(f"# {f.name} = {str(default).lower()}")
        elif isinstance(default, list):
            lines.append(f"# {f.name} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in default)}]")
        else:
            lines.append(f"# {f.name} = {default}")
        lines.append("")
    return "\n".join(lines)


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def new_token() -> str:
    return secrets.token_urlsafe(24)
