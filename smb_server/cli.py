"""The ``smb`` command: daemons, a local cluster and cluster inspection."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Sequence

from smb_client import Client, errors
from smb_client.units import format_bytes, parse_size

from . import doctor, logs
from .config import (DEFAULT_CONTROLLER_FILE, DEFAULT_SERVER_FILE, ControllerConfig, ServerConfig,
                     ConfigError, load, settings)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controller", default=os.environ.get("SMB_CONTROLLER", "127.0.0.1:7700"),
                   help="controller host:port (env SMB_CONTROLLER)")
    p.add_argument("--token", default=os.environ.get("SMB_TOKEN", ""),
                   help="bearer token (env SMB_TOKEN)")


def _flags(args: argparse.Namespace, cls: type) -> dict:
    """The options given on the command line that name a setting of ``cls``."""
    names = {f.name for f in settings(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def cmd_controller(args: argparse.Namespace) -> int:
    from .controller.main import serve
    cfg = load(ControllerConfig, args.config, default_path=DEFAULT_CONTROLLER_FILE,
               flags=_flags(args, ControllerConfig))
    logs.setup(cfg.log_level, cfg.log_format)
    logs.set_context(daemon="controller")
    if not cfg.secret:
        print("smb controller: no secret: set secret_file in the config, pass --secret-file "
              "or set SMB_SECRET", file=sys.stderr)
        return 2
    serve(cfg)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    if args.action in ("drain", "undrain"):
        return _server_drain(args, undrain=args.action == "undrain")
    from .memserver.main import serve
    cfg = load(ServerConfig, args.config, default_path=DEFAULT_SERVER_FILE,
               flags=_flags(args, ServerConfig))
    logs.setup(cfg.log_level, cfg.log_format)
    logs.set_context(daemon="memory-server")
    if not cfg.secret:
        print("smb server: no secret: set secret_file in the config, pass --secret-file "
              "or set SMB_SECRET", file=sys.stderr)
        return 2
    serve(cfg)
    return 0


def _server_drain(args: argparse.Namespace, undrain: bool) -> int:
    """``smb server drain``: the server named by this host's configuration (its
    ``server_id``, or the id kept in its ``state_dir``) takes no new extents; the
    regions it holds keep working. ``smb server undrain`` reverses it."""
    from .memserver.main import read_server_id
    cfg = load(ServerConfig, args.config, default_path=DEFAULT_SERVER_FILE,
               flags=_flags(args, ServerConfig), with_secret=False)
    server_id = cfg.server_id or read_server_id(cfg.state_dir)
    with Client(cfg.controller, cfg.token) as c:
        s = c.drain_server(server_id, undrain=undrain)
    if undrain:
        print(f"server {s.server_id} at {s.grpc_address}: {s.state}; new extents may be placed on it")
    else:
        print(f"server {s.server_id} at {s.grpc_address}: {s.state}; no new extents go there, "
              f"its {s.extents} extent(s) ({format_bytes(s.used)}) keep serving")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a configuration file (and the secret file it names); print the settings
    it gives, the token masked. SMB_* variables count only with ``--env``."""
    cls = ControllerConfig if args.kind == "controller" else ServerConfig
    cfg = load(cls, args.path, env=None if args.env else {})
    for f in settings(cls):
        value = getattr(cfg, f.name)
        if f.name == "token" and value:
            value = "(set)"
        print(f"{f.name} = {value!r}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from .local_cluster import LocalCluster
    cluster = LocalCluster(args.servers, args.capacity, workdir=args.workdir,
                           controller_port=args.port, token=args.token or None)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster.start()
    try:
        print(f"Soft Memory Box: controller at {cluster.address}, {args.servers} memory servers "
              f"of {format_bytes(cluster.capacity)} (logs in {cluster.workdir})")
        print("Use it from another shell with:\n" + cluster.describe(), flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        print("stopping local cluster", flush=True)
        cluster.stop()
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    import json
    from . import status
    with Client(args.controller, args.token) as c:
        report = status.gather(c, metrics=args.metrics)
    print(json.dumps(report, indent=2) if args.json else status.render(report))
    return 0


def cmd_region(args: argparse.Namespace) -> int:
    with Client(args.controller, args.token) as c:
        if args.action == "create":
            segments = [parse_size(s) for s in args.segments.split(",")] if args.segments else []
            size = parse_size(args.size) if args.size else sum(segments)
            r = c.create_region(args.name, size, placement=args.placement,
                                stripe_unit=parse_size(args.stripe_unit), num_servers=args.servers,
                                segment_sizes=segments, persistent=args.persistent)
            print(f"created {r.name}: {format_bytes(r.size)} {r.placement} over {len(r.extents)} servers")
            r.close()
        elif args.action == "ls":
            regions = c.list_regions(args.name or "")
            print(_table([[r.name, str(r.size), r.placement, r.state, ",".join(r.servers)] for r in regions],
                         ["NAME", "BYTES", "PLACEMENT", "STATE", "SERVERS"]))
        elif args.action == "rm":
            c.delete_region(args.name)
            print(f"deleted {args.name}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    with Client(args.controller, args.token) as c:
        s = c.drain_server(args.server_id, undrain=args.undrain)
    print(f"{s.server_id}: {s.state}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Run a training example (``examples/train_<name>.py``) against a cluster."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "examples" / f"train_{args.example}.py"
    if not script.is_file():
        known = sorted(p.stem.removeprefix("train_") for p in script.parent.glob("train_*.py"))
        print(f"smb train: no example {args.example!r} ({script} is missing); examples: "
              + (", ".join(known) or "none (run from a source checkout)"), file=sys.stderr)
        return 2
    argv = [sys.executable, str(script), "--scheme", args.scheme, "--workers", str(args.workers),
            "--placement", args.placement]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    if args.quiet:
        argv.append("--quiet")
    controller = None if args.local else (args.controller or os.environ.get("SMB_CONTROLLER"))
    if controller:  # otherwise the example starts a local cluster
        # "=" form: a token may start with "-"
        argv += [f"--controller={controller}", f"--token={args.token or os.environ.get('SMB_TOKEN', '')}"]
    return subprocess.call(argv + list(args.extra))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smb", description="Soft Memory Box")
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING, ERROR (env SMB_LOG_LEVEL; daemons: also log_level)")
    parser.add_argument("--log-format", default=None, choices=logs.FORMATS,
                        help="text or json lines (env SMB_LOG_FORMAT; daemons: also log_format)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run the controller daemon")
    p.add_argument("--config", default=None, help=f"TOML file (default {DEFAULT_CONTROLLER_FILE} if present)")
    p.add_argument("--listen", help="host:port to serve on")
    p.add_argument("--db", dest="db_path", help="SQLite file")
    p.add_argument("--token", help="bearer token")
    p.add_argument("--secret-file")
    p.add_argument("--lease", dest="lease_seconds", type=float, help="server lease, seconds")
    p.add_argument("--orphan-grace", dest="orphan_grace_seconds", type=float,
                   help="seconds before unknown extents are freed")
    p.add_argument("--ticket-ttl", dest="ticket_ttl_seconds", type=float)
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-host", help="address of the metrics endpoint (default: the listen host)")
    p.add_argument("--ready-file")
    p.set_defaults(fn=cmd_controller)

    p = sub.add_parser("server", help="run a memory server daemon, or drain/undrain it",
                       description="smb server [run]: run the daemon. smb server drain: the server "
                                   "this configuration names (server_id, or the id kept in "
                                   "state_dir) takes no new extents; its regions keep working. "
                                   "smb server undrain: it takes new extents again.")
    p.add_argument("action", nargs="?", default="run", choices=["run", "drain", "undrain"])
    p.add_argument("--config", default=None, help=f"TOML file (default {DEFAULT_SERVER_FILE} if present)")
    p.add_argument("--controller", help="controller host:port")
    p.add_argument("--token", help="bearer token")
    p.add_argument("--listen-host")
    p.add_argument("--advertise-host")
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--tcp-port", type=int)
    p.add_argument("--capacity", help="RAM to offer, e.g. 512M, 16G")
    p.add_argument("--secret-file")
    p.add_argument("--server-id")
    p.add_argument("--state-dir")
    p.add_argument("--data-dir", help="directory for file-backed (persistent) extents")
    p.add_argument("--transports", help="comma-separated: tcp,shm,rdma")
    p.add_argument("--rdma-device")
    p.add_argument("--heartbeat", dest="heartbeat_seconds", type=float, help="seconds between heartbeats")
    p.add_argument("--tcp-connections-max", type=int, help="most concurrent TCP data-plane connections")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-host", help="address of the metrics endpoint (default: listen host)")
    p.add_argument("--ready-file")
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("check-config", help="validate a controller or memory server TOML file",
                       description="Exit 0 and print the effective settings when the file (and the "
                                   "secret file it names) is valid; exit 2 with the file, key and "
                                   "expected type otherwise.")
    p.add_argument("kind", choices=["controller", "server"])
    p.add_argument("path")
    p.add_argument("--env", action="store_true", help="apply this environment's SMB_* variables too")
    p.set_defaults(fn=cmd_check_config)

    p = sub.add_parser("up", help="run a local cluster (controller + memory servers) in the foreground")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--capacity", default="1G", help="per memory server")
    p.add_argument("--port", type=int, default=7700, help="controller port (0: any)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--token", default="")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("status", help="print the cluster: servers (health, counters), regions",
                       description="Servers as the controller sees them, with each server's health "
                                   "(gRPC health service) and counters (its Stats call), and the "
                                   "regions.")
    _common(p)
    p.add_argument("--metrics", action="store_true",
                   help="also read each memory server's /metrics and print operation latencies")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("region", help="create, list or delete regions")
    _common(p)
    p.add_argument("action", choices=["create", "ls", "rm"])
    p.add_argument("name", nargs="?")
    p.add_argument("size", nargs="?", help="bytes, e.g. 64M")
    p.add_argument("--placement", default="striped", choices=["striped", "layered", "single"])
    p.add_argument("--stripe-unit", default="0")
    p.add_argument("--servers", type=int, default=0)
    p.add_argument("--segments", default="", help="layered: comma-separated segment sizes")
    p.add_argument("--persistent", action="store_true")
    p.set_defaults(fn=cmd_region)

    p = sub.add_parser("train", help="train an example model (digits) through the memory box",
                       description="Runs examples/train_<example>.py: a local cluster unless --controller "
                                   "or SMB_CONTROLLER names one, then each scheme under torchrun. "
                                   "Arguments after -- go to the example.")
    p.add_argument("--example", default="digits", help="examples/train_<example>.py (default digits)")
    p.add_argument("--controller", default=None, help="controller host:port (default $SMB_CONTROLLER)")
    p.add_argument("--token", default=None, help="bearer token (default $SMB_TOKEN)")
    p.add_argument("--local", action="store_true", help="start a local cluster even if SMB_CONTROLLER is set")
    p.add_argument("--scheme", default="all", choices=["all", "sync", "seasgd", "hybrid", "ddp"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--placement", default="striped", choices=["striped", "layered", "single"])
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("extra", nargs="*", help="further example options, after --")
    p.set_defaults(fn=cmd_train)

    doctor.add_parser(sub)

    p = sub.add_parser("drain", help="stop placing new extents on a memory server")
    _common(p)
    p.add_argument("server_id")
    p.add_argument("--undrain", action="store_true")
    p.set_defaults(fn=cmd_drain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # daemons take these from their configuration too (flag > SMB_* > file); until it is
    # read, and for every other command, the flag or the environment decides
    try:
        logs.setup(args.log_level or os.environ.get("SMB_LOG_LEVEL") or "INFO",
                   args.log_format or os.environ.get("SMB_LOG_FORMAT") or "text")
    except ValueError as exc:
        print(f"smb: {exc}", file=sys.stderr)
        return 2
    if args.command == "region" and args.action in ("create", "rm") and not args.name:
        print(f"smb region {args.action}: a region name is required", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"smb {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except errors.SMBError as exc:
        print(f"smb {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
