"""Settings of the controller and the memory server.

Precedence, lowest to highest: built-in defaults, the TOML file
(``/etc/smb/controller.toml`` or ``/etc/smb/server.toml``, or ``--config PATH``),
``SMB_*`` environment variables (``SMB_`` + the key in upper case, e.g.
``SMB_CAPACITY``), then command-line flags. Every key is documented in the field's
``doc`` below and in ``deploy/config/*.toml``. A file with an unknown key, a value of
the wrong type or a value out of range (a port above 65535, an unknown transport or log
level) is refused with an error naming the file (or variable, or flag), the key and
what was expected, so a daemon never starts half-configured.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from smb_protocol.errors import InvalidArgument
from smb_protocol.tls import TLSConfig
from smb_protocol.units import parse_size

from . import affinity

DEFAULT_CONTROLLER_FILE = "/etc/smb/controller.toml"
DEFAULT_SERVER_FILE = "/etc/smb/server.toml"


class ConfigError(InvalidArgument):
    """A configuration file, variable or flag with a bad key or value."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
TRANSPORTS = ("tcp", "shm", "rdma")
MAX_PORT = 65535


def _f(default: Any, doc: str, kind: str = "", *, choices: tuple[str, ...] = (),
       minimum: float | None = None, maximum: float | None = None, positive: bool = False,
       aliases: tuple[str, ...] = ()) -> Any:
    """A setting: its default, its documentation and the checks its value must pass.
    The ``smb`` command's flags are made from these (``--<name-with-dashes>``).

    ``choices``: allowed values (each element, for a list); ``minimum``/``maximum``:
    inclusive bounds; ``positive``: strictly above zero; ``aliases``: further flag
    names (``--db`` for ``db_path``).
    """
    meta = {"doc": doc, "kind": kind, "choices": choices, "minimum": minimum,
            "maximum": maximum, "positive": positive, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _port(default: int, doc: str) -> Any:
    return _f(default, doc, minimum=0, maximum=MAX_PORT)


@dataclass
class ControllerConfig:
    listen: str = _f("127.0.0.1:7700", "host:port of the gRPC service (port 0: any free port)")
    db_path: str = _f("smb-controller.db", "SQLite database file (WAL mode)", aliases=("--db",))
    store: str = _f("", "where the state lives: empty for the SQLite file db_path, or "
                    "etcd://host:port[,host:port...][/prefix] for etcd (several controllers, "
                    "one leader)")
    leader_lease_seconds: float = _f(5.0, "with etcd: a leader silent this long (seconds, whole, "
                                     "at least 2) is replaced by a standby", minimum=2)
    token: str = _f("", "bearer token of the client role (set it in the file or SMB_TOKEN, "
                    "not on a command line)")
    secret_file: str = _f("", "file holding the HMAC ticket secret (hex), shared with memory servers")
    admin_token_file: str = _f("", "file holding a further admin credential, for operators who "
                               "do not hold the secret (the one derived from the secret always works)")
    insecure: bool = _f(False, "serve without authentication (no token or secret needed); "
                        "anyone who reaches the port may do anything")
    tls_ca: str = _f("", "PEM file of the CA that signs the cluster's certificates; set, the "
                     "gRPC service serves TLS and peers are checked against it")
    tls_cert: str = _f("", "PEM file of this daemon's certificate (chain), for TLS")
    tls_key: str = _f("", "PEM file of the private key of tls_cert")
    tls_client_auth: bool = _f(False, "with TLS, refuse clients without a certificate signed "
                               "by tls_ca")
    barrier_waits_max: int = _f(64, "callers that may wait in barriers at once; more are "
                                "refused as busy", minimum=1)
    lease_seconds: float = _f(5.0, "a memory server silent this long (seconds) is marked down",
                              positive=True, aliases=("--lease",))
    orphan_grace_seconds: float = _f(30.0, "extents unknown to the controller are freed after "
                                     "this age (seconds)", minimum=0,
                                     aliases=("--orphan-grace",))
    ticket_ttl_seconds: float = _f(3600.0, "lifetime of region tickets (seconds)", positive=True,
                                    aliases=("--ticket-ttl",))
    metrics_port: int = _port(0, "Prometheus /metrics and /healthz HTTP port (0: off)")
    metrics_host: str = _f("", "address of the metrics endpoint (default: the host of listen)")
    ready_file: str = _f("", "written with the bound address once serving")
    log_level: str = _f("INFO", "DEBUG, INFO, WARNING or ERROR", choices=LOG_LEVELS)
    log_format: str = _f("text", "text, or json for one JSON object per line", choices=LOG_FORMATS)
    secret: bytes = field(default=b"", metadata={"internal": True})


@dataclass
class ServerConfig:
    controller: str = _f("127.0.0.1:7700", "host:port of the controller, or a comma-separated list "
                         "of controllers sharing an etcd store (the server follows the leader)")
    listen_host: str = _f("127.0.0.1", "address of the gRPC service and the TCP data plane")
    advertise_host: str = _f("", "address clients use to reach this server (default listen_host)")
    grpc_port: int = _port(0, "gRPC port (0: any free port)")
    tcp_port: int = _port(0, "TCP data-plane port (0: any free port)")
    capacity: int = _f(1 << 30, "bytes of RAM this server may hand out (e.g. 64G)", "size", minimum=0)
    token: str = _f("", "bearer token of the cluster")
    secret_file: str = _f("", "file holding the HMAC ticket secret (hex), shared with the controller")
    tls_ca: str = _f("", "PEM file of the CA that signs the cluster's certificates; set, the "
                     "gRPC service and the TCP data plane serve TLS and peers are checked against it")
    tls_cert: str = _f("", "PEM file of this daemon's certificate (chain), for TLS")
    tls_key: str = _f("", "PEM file of the private key of tls_cert")
    tls_client_auth: bool = _f(False, "with TLS, refuse clients without a certificate signed "
                               "by tls_ca")
    server_id: str = _f("", "stable id (default: generated once and kept in state_dir)")
    state_dir: str = _f("", "where the server keeps its id and its shm socket")
    data_dir: str = _f("", "directory for file-backed (persistent) extents; empty: memory only")
    writeback_seconds: float = _f(10.0, "seconds between write-backs of file-backed extents to "
                                  "data_dir (0: only when the server stops)", minimum=0)
    persistent_keeper: bool = _f(True, "hand the memory of file-backed extents to a keeper process "
                                 "so that a crash of the server (kill -9, OOM) loses no "
                                 "acknowledged write; off: a crash loses what was written since "
                                 "the last write-back")
    transports: list[str] = _f(["tcp", "shm"], "data planes to offer: tcp, shm, rdma", choices=TRANSPORTS)
    rdma_device: str = _f("", "RDMA device to use (default: the first active one)")
    heartbeat_seconds: float = _f(1.0, "seconds between heartbeats to the controller", positive=True,
                                   aliases=("--heartbeat",))
    replica_dead_peer_seconds: float = _f(3.0, "seconds a backup server may acknowledge nothing "
                                          "(no TCP ack of data or probes) before this server, its "
                                          "primary, marks it failed and reports it; raise it on "
                                          "starved or emulated hosts, with tcp_dead_peer_seconds", positive=True)
    tcp_connections_max: int = _f(1024, "most concurrent TCP data-plane connections", minimum=1)
    tcp_connections_per_peer: int = _f(128, "most concurrent TCP data-plane connections from one "
                                        "client address", minimum=1)
    tcp_connections_unauthenticated: int = _f(256, "most TCP data-plane connections that have not "
                                              "presented a valid ticket yet; one more evicts the "
                                              "oldest of the address holding the most (they do not "
                                              "count against the two limits above)", minimum=1)
    tcp_hello_timeout_seconds: float = _f(5.0, "seconds a new TCP data-plane connection has to "
                                          "present its first ticket", positive=True)
    tcp_frame_timeout_seconds: float = _f(60.0, "seconds a TCP data-plane request (header and "
                                          "payload) has to arrive whole", positive=True)
    tcp_dead_peer_seconds: float = _f(3.0, "seconds of unanswered keepalive probes after which "
                                      "the TCP data plane ends a connection waiting for its "
                                      "client (host or link gone) and frees what its request "
                                      "held", positive=True)
    tcp_scratch_bytes: int = _f(64 << 20, "bytes of scratch buffers the TCP data plane shares "
                                "among its connections for accumulate (e.g. 64M)", "size",
                                minimum=4 << 20)
    shm_connections_max: int = _f(256, "most concurrent connections to the shm socket", minimum=1)
    shm_connections_per_user: int = _f(128, "most concurrent connections to the shm socket from "
                                       "one user id", minimum=1)
    shm_connections_unauthenticated: int = _f(64, "most connections to the shm socket that have not "
                                              "presented a valid ticket yet; one more evicts the "
                                              "oldest of the user holding the most", minimum=1)
    cpus: str = _f("", "CPU cores the server's process runs on, as taskset names them (e.g. 2 "
                   "or 0-3); empty: any. Collectives over tcp run on as many cores as it has; "
                   "its Python request threads share one interpreter lock (docs/operations.md)", "cpus")
    metrics_port: int = _port(0, "Prometheus /metrics and /healthz HTTP port (0: off)")
    metrics_host: str = _f("", "address of the metrics endpoint (default: listen_host)")
    ready_file: str = _f("", "written with the server id once registered")
    log_level: str = _f("INFO", "DEBUG, INFO, WARNING or ERROR", choices=LOG_LEVELS)
    log_format: str = _f("text", "text, or json for one JSON object per line", choices=LOG_FORMATS)
    secret: bytes = field(default=b"", metadata={"internal": True})


C = TypeVar("C", ControllerConfig, ServerConfig)

_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "list[str]": "a list of strings", "size": "a size such as 4096 or \"16G\"",
               "cpus": "CPU cores such as \"2\" or \"0-3,8\", on this host"}


def settings(cls: type) -> list[dataclasses.Field[Any]]:
    """The configurable fields of a config class."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def default_of(f: dataclasses.Field[Any]) -> Any:
    """The built-in default of a setting."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _convert(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """``value`` as the field's type, checked against its bounds and choices."""
    return _check(f, _typed(f, value, where), where)


def _typed(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    kind = f.metadata.get("kind") or str(f.type)
    if kind == "cpus" and isinstance(value, str):
        try:
            affinity.parse(value)
        except InvalidArgument as exc:
            raise ConfigError(f"{where}: key {f.name!r} must be {_TYPE_NAMES[kind]}: {exc}") from None
        return value
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


def _check(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """Raise ConfigError when ``value`` is outside the field's choices or bounds.

    Log levels are case-insensitive and returned in upper case.
    """
    meta = f.metadata
    choices = meta.get("choices") or ()
    if choices:
        if f.name == "log_level" and isinstance(value, str):
            value = value.upper()
        items = value if isinstance(value, list) else [value]
        bad = [v for v in items if v not in choices]
        if bad:
            each = "each " if isinstance(value, list) else ""
            raise ConfigError(f"{where}: key {f.name!r} must be {each}one of {', '.join(choices)}, "
                              f"got {bad[0]!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = meta.get("minimum"), meta.get("maximum")
        if meta.get("positive") and value <= 0:
            raise ConfigError(f"{where}: key {f.name!r} must be above 0, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
            raise ConfigError(f"{where}: key {f.name!r} must be {span}, got {value!r}")
    return value


def _from_text(f: dataclasses.Field[Any], text: str, where: str) -> Any:
    """A value from an environment variable or a flag's text, converted and checked."""
    kind = f.metadata.get("kind") or str(f.type)
    if kind not in ("int", "float", "bool", "list[str]"):
        return _convert(f, text, where)
    try:
        if kind == "int":
            value: Any = int(text)
        elif kind == "float":
            value = float(text)
        elif kind == "bool":
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            value = text.lower() in ("1", "true", "yes")
        else:
            value = [t.strip() for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{where}: key {f.name!r} must be {_TYPE_NAMES.get(kind, kind)}, "
                          f"got {text!r}") from None
    return _check(f, value, where)


def load(cls: type[C], path: str | None = None, *, default_path: str = "",
         env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None,
         with_secret: bool = True) -> C:
    """Build a config: defaults < TOML file < ``SMB_*`` environment < flags.

    ``path`` names the file (it must exist); without it ``default_path`` is read when
    present. ``flags`` holds only the options given on the command line (None = not
    given). ``with_secret``: also read the ticket secret (daemons need it, commands that
    only talk to the controller do not). Raises :class:`ConfigError` naming the file or
    variable, key and type.
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
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read the configuration file: {exc.strerror}") from None
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
    check_tls(cfg, file)
    if with_secret:
        cfg.secret = load_secret(cfg.secret_file, env=env)
    return cfg


def check_tls(cfg: ControllerConfig | ServerConfig, file: str = "") -> None:
    """Raise ConfigError when the TLS settings do not fit together: a certificate without
    its key or CA, a CA without this daemon's certificate, a file that cannot be read,
    ``tls_client_auth`` without TLS."""
    tls = TLSConfig(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    where = file or "settings"
    if cfg.tls_client_auth and not tls.enabled:
        raise ConfigError(f"{where}: tls_client_auth needs TLS: set tls_ca, tls_cert and tls_key")
    if tls.enabled or tls.cert or tls.key:
        try:
            tls.server_context()   # reads the files: PEM, and the key of the certificate
        except InvalidArgument as exc:
            raise ConfigError(f"{where}: {exc}") from None


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
        default = default_of(f)
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
