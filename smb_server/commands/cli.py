"""The ``smb`` command: daemons, a local cluster and cluster inspection."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from smb_client import Client
from smb_protocol import errors
from smb_protocol.units import format_bytes, parse_size
from smb_server.commands import doctor, pool, up
from smb_server.commands.flags import add_setting_flags, setting_flags
from smb_server.commands.server_admin import ADMIN_ACTIONS, ServerHelp, admin_options, run_admin, server_config
from smb_server.commands.tokens import client_token, warn_token_flag
from smb_server.runtime import affinity, logs
from smb_server.runtime.config import (
    DEFAULT_CONTROLLER_FILE,
    DEFAULT_SERVER_FILE,
    ConfigError,
    ControllerConfig,
    ServerConfig,
    load,
    settings,
)

# the exit status when stdout's reader went away (`smb status | head`), as after SIGPIPE
BROKEN_PIPE_EXIT = 141


def _common(p: argparse.ArgumentParser) -> None:
    # None: the client takes $SMB_CONTROLLER (or its default) and says which in its errors
    p.add_argument("--controller", default=None,
                   help="controller host:port (default: env SMB_CONTROLLER, else 127.0.0.1:7700)")
    p.add_argument("--token", default=None,
                   help="bearer token (default: env SMB_TOKEN, which is better: a flag shows in ps)")


def cmd_controller(args: argparse.Namespace) -> int:
    from smb_server.controller.main import serve
    cfg = load(ControllerConfig, args.config, default_path=DEFAULT_CONTROLLER_FILE,
               flags=setting_flags(args, ControllerConfig))
    logs.setup(cfg.log_level, cfg.log_format)
    logs.set_context(daemon="controller")
    warn_token_flag(args, "controller")
    if not cfg.secret and not cfg.insecure:
        print("smb controller: no secret: set secret_file in the config, pass --secret-file "
              "or set SMB_SECRET (or, for a trusted test setup only, --insecure)", file=sys.stderr)
        return 2
    if not cfg.insecure:
        from smb_server.controller.main import check_credentials
        check_credentials(cfg)  # ConfigError (exit 2) when a credential is missing
    serve(cfg)
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    if args.action in ADMIN_ACTIONS:
        return run_admin(args)
    from smb_server.memserver.main import serve
    cfg = load(ServerConfig, args.config, default_path=DEFAULT_SERVER_FILE,
               flags=setting_flags(args, ServerConfig))
    logs.setup(cfg.log_level, cfg.log_format)
    logs.set_context(daemon="memory-server")
    warn_token_flag(args, "server")
    if not cfg.secret:
        print("smb server: no secret: set secret_file in the config, pass --secret-file "
              "or set SMB_SECRET", file=sys.stderr)
        return 2
    affinity.pin(cfg.cpus)   # before the server starts a thread: they all inherit it
    serve(cfg)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a configuration file (and the secret file it names); print the settings
    it gives, the token masked. SMB_* variables count only with ``--env``."""
    env: dict[str, str] | None = None if args.env else {}
    cfg: ControllerConfig | ServerConfig = (
        load(ControllerConfig, args.path, env=env) if args.kind == "controller"
        else load(ServerConfig, args.path, env=env))
    for f in settings(type(cfg)):
        value = getattr(cfg, f.name)
        if f.name == "token" and value:
            value = "(set)"
        print(f"{f.name} = {value!r}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from smb_server.runtime.certs import make_cluster_certs
    made = make_cluster_certs(args.directory, args.host, args.days)
    print(f"CA {made.ca} (key {made.ca_key}: keep it off the cluster)\n"
          f"daemons: {made.server_cert} {made.server_key} (names {', '.join(args.host) or 'this host'})\n"
          f"clients: {made.client_cert} {made.client_key}\n"
          f"clients set SMB_TLS_CA={made.ca} SMB_TLS_CERT={made.client_cert} "
          f"SMB_TLS_KEY={made.client_key}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from smb_server.commands import status
    with Client(args.controller, client_token(args)) as c:
        report = status.gather(c, metrics=args.metrics)
    if args.json:
        print(json.dumps(report, indent=2))
        if args.metrics and not status.serves_metrics(report):
            print(f"smb status: {status.NO_METRICS}", file=sys.stderr)
    else:
        print(status.render(report, metrics=args.metrics))
    return 0


def cmd_region(args: argparse.Namespace) -> int:
    with Client(args.controller, client_token(args)) as c:
        if args.action == "create":
            segments = [parse_size(s) for s in args.segments.split(",")] if args.segments else []
            size = parse_size(args.size) if args.size else sum(segments)
            try:
                r = c.create_region(args.name, size, placement=args.placement,
                                    stripe_unit=parse_size(args.stripe_unit), num_servers=args.num_servers,
                                    segment_sizes=segments, persistent=args.persistent, replicas=args.replicas)
            except errors.RegionExists:
                raise errors.RegionExists(f"region {args.name!r} already exists; delete it first with "
                                          f"`smb region rm {args.name}`, or pick another name") from None
            print(f"created {r.name}: {format_bytes(r.size)} {r.placement} over {len(r.extents)} servers")
            r.close()
        elif args.action == "ls":
            from .status import region_row, region_table
            print(region_table([region_row(r) for r in c.list_regions(args.name or "")]))
        elif args.action == "rm" and args.prefix:
            deleted = c.delete_regions(args.prefix)
            print(f"deleted {len(deleted)} region(s) under {args.prefix}" + "".join(f"\n  {n}" for n in deleted))
        elif args.action == "rm":
            c.delete_region(args.name)
            print(f"deleted {args.name}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Run the digits example (:mod:`smb_train.digits`) against a cluster."""
    from smb_train import digits
    argv = ["--scheme", args.scheme, "--workers", str(args.workers), "--placement", args.placement]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    if args.quiet:
        argv.append("--quiet")
    if args.replace:
        argv.append("--replace")
    if args.max_restarts:
        argv += ["--max-restarts", str(args.max_restarts)]
    controller = None if args.local else (args.controller or os.environ.get("SMB_CONTROLLER"))
    if controller:  # otherwise the example starts a local cluster
        # the token stays in the environment (SMB_TOKEN), never on a command line
        argv += [f"--controller={controller}"]
    return digits.main(argv + list(args.extra))


def _version() -> str:
    try:
        return metadata.version("soft-memory-box")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _region_parsers(sub: Any) -> None:
    """``smb region create|ls|rm``, each with its own help."""
    region = sub.add_parser("region", help="create, list or delete regions",
                            description="smb region create NAME SIZE | ls [PREFIX] | rm NAME | "
                                        "rm --prefix PREFIX; `smb region create --help` and the "
                                        "like list each one's options.")
    actions = region.add_subparsers(dest="action", required=True, metavar="{create,ls,rm}")
    p = actions.add_parser("create", help="create a region (striped over all servers by default)",
                           description="Create region NAME of SIZE bytes (e.g. 256M, 2G), e.g. "
                                       "`smb region create job/params 256M`; layered regions may "
                                       "give --segments instead of SIZE.")
    _common(p)
    p.add_argument("name", nargs="?", help="region name, e.g. job/params")
    p.add_argument("size", nargs="?", help="bytes, e.g. 64M (layered: default the segments' sum)")
    p.add_argument("--placement", default="striped", choices=["striped", "layered", "single"],
                   help="how extents are laid over servers (default striped)")
    p.add_argument("--stripe-unit", default="0", help="striped: bytes per stripe (default 0: the controller's)")
    p.add_argument("--num-servers", type=int, default=0,
                   help="memory servers to spread the region over (default 0: all that fit)")
    p.add_argument("--segments", default="", help="layered: comma-separated segment sizes")
    p.add_argument("--persistent", action="store_true", help="file-backed extents (servers with data_dir)")
    p.add_argument("--replicas", type=int, default=1, help="copies of every byte (1 to 3)")
    p.set_defaults(fn=cmd_region, prefix="")
    p = actions.add_parser("ls", help="list regions (sizes in KiB/MiB/GiB)",
                           description="List the regions whose names start with PREFIX (all without).")
    _common(p)
    p.add_argument("name", nargs="?", metavar="PREFIX", help="a name prefix, e.g. job/")
    p.set_defaults(fn=cmd_region, prefix="")
    p = actions.add_parser("rm", help="delete a region, or every region under --prefix",
                           description="Delete region NAME, or with --prefix every region whose "
                                       "name starts with PREFIX (e.g. what a job left behind).")
    _common(p)
    p.add_argument("name", nargs="?", help="region name")
    p.add_argument("--prefix", default="", help="delete every region whose name starts with this, e.g. job/")
    p.set_defaults(fn=cmd_region)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smb", description="Soft Memory Box")
    parser.add_argument("--version", action="version", version=f"smb (soft-memory-box) {_version()}")
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING, ERROR (env SMB_LOG_LEVEL; daemons: also log_level)")
    parser.add_argument("--log-format", default=None, choices=logs.FORMATS,
                        help="text or json lines (env SMB_LOG_FORMAT; daemons: also log_format)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("controller", help="run the controller daemon",
                       description="Settings: flag > SMB_* variable > --config file > default.")
    p.add_argument("--config", default=None, help=f"TOML file (default {DEFAULT_CONTROLLER_FILE} if present)")
    add_setting_flags(p, ControllerConfig)
    p.set_defaults(fn=cmd_controller)

    p = sub.add_parser("server", help="run a memory server daemon, or drain/undrain it", add_help=False,
                       description="smb server [run]: run the daemon. smb server drain: the server "
                                   "named by --server-id, or else by this configuration (server_id, "
                                   "or the id kept in state_dir), takes no new extents; its regions "
                                   "keep working. smb server undrain: it takes new extents again. "
                                   "`smb server drain --help` (undrain, remove) lists only what "
                                   "that action takes. "
                                   "Settings: flag > SMB_* variable > --config file > default.")
    p.add_argument("-h", "--help", action=ServerHelp, help="show this help message and exit")
    p.add_argument("action", nargs="?", default="run", choices=["run", *ADMIN_ACTIONS],
                   help="run the daemon (default), drain/undrain the server, or remove a drained, "
                        "empty one from the pool")
    admin_options(p, drain=True)
    add_setting_flags(p, ServerConfig)
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("check-config", help="validate a controller or memory server TOML file",
                       description="Exit 0 and print the effective settings when the file (and the "
                                   "secret file it names) is valid; exit 2 with the file, key and "
                                   "expected type otherwise.")
    p.add_argument("kind", choices=["controller", "server"], help="which daemon's file")
    p.add_argument("path", help="the TOML file")
    p.add_argument("--env", action="store_true", help="apply this environment's SMB_* variables too")
    p.set_defaults(fn=cmd_check_config)

    up.add_parsers(sub)

    pool.add_parser(sub, DEFAULT_SERVER_FILE, lambda args: pool.cmd_rebalance(args, server_config(args)))

    p = sub.add_parser("certs", help="make a CA and TLS certificates for a small cluster",
                       description="Writes ca.pem/ca.key, server.pem/server.key (for every daemon: "
                                   "TLS server and client, naming localhost, this host and each "
                                   "--host) and client.pem/client.key into DIRECTORY. "
                                   "For tests and small clusters; see docs/operations.md (TLS).")
    p.add_argument("directory", help="where the files go (created)")
    p.add_argument("--host", action="append", default=[],
                   help="a name or address daemons are reached at (repeat for each host)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.set_defaults(fn=cmd_certs)

    p = sub.add_parser("status", help="print the cluster: servers (health, counters), regions",
                       description="Servers as the controller sees them, with each server's health "
                                   "(gRPC health service) and counters (its Stats call), and the "
                                   "regions.")
    _common(p)
    p.add_argument("--metrics", action="store_true",
                   help="also read each memory server's /metrics and print operation latencies")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(fn=cmd_status)

    _region_parsers(sub)

    p = sub.add_parser("train", help="train an example model (digits) through the memory box",
                       description="Trains a small network on scikit-learn's digits: a local cluster "
                                   "unless --controller or SMB_CONTROLLER names one, then each scheme "
                                   "under torchrun. Arguments after -- go to the trainer "
                                   "(python -m smb_train.digits --help lists them).")
    p.add_argument("--controller", default=None, help="controller host:port (default $SMB_CONTROLLER)")
    p.add_argument("--local", action="store_true", help="start a local cluster even if SMB_CONTROLLER is set")
    p.add_argument("--scheme", default="all", choices=["all", "sync", "seasgd", "hybrid", "ddp"],
                   help="update scheme (default all: sync, seasgd, hybrid)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (default 20)")
    p.add_argument("--placement", default="striped", choices=["striped", "layered", "single"],
                   help="placement of the parameter regions (default striped)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--replace", action="store_true",
                   help="delete regions an unfinished run left under the job's namespace (default: refuse)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun starts the workers again up to this many times after one dies "
                        "(default 0); the job goes on from the store in the memory box")
    p.add_argument("extra", nargs="*", help="further trainer options, after --")
    p.set_defaults(fn=cmd_train)

    doctor.add_parser(sub)
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
    if args.command == "region" and args.action in ("create", "rm") and not args.name \
            and not (args.action == "rm" and args.prefix):
        print(f"smb region {args.action}: a region name is required"
              + (" (or --prefix PREFIX)" if args.action == "rm" else ""), file=sys.stderr)
        return 2
    if args.command == "region" and args.action == "rm" and args.name and args.prefix:
        print("smb region rm: give a region name or --prefix, not both", file=sys.stderr)
        return 2
    if args.command == "region" and args.action == "create" and not args.size and not args.segments:
        print(f"smb region create: a size is required, e.g. `smb region create {args.name} 256M` "
              "(or, layered, --segments 128M,128M)", file=sys.stderr)
        return 2
    try:
        code: int = args.fn(args)
        sys.stdout.flush()      # a reader that went away shows here, not at the exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except ConfigError as exc:
        print(f"smb {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except errors.SMBError as exc:
        print(f"smb {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """stdout's reader went away (``smb status | head``): end quietly, as a command
    stopped by SIGPIPE would, and let nothing flush into the closed pipe at the exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
