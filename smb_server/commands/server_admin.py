"""``smb server drain|undrain|remove``: the operator's actions on one memory server,
with their own help (the options each action reads, not the daemon's settings)."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from smb_protocol.units import format_bytes
from smb_server.commands import pool
from smb_server.commands.flags import add_setting_flags, setting_flags
from smb_server.runtime.config import DEFAULT_SERVER_FILE, ServerConfig, load

# the actions, and the memory-server settings they read (pool.admin_client)
ADMIN_ACTIONS = ("drain", "undrain", "remove")
ADMIN_SETTINGS = ("controller", "token", "secret_file", "tls_ca", "tls_cert", "tls_key", "server_id", "state_dir")
ADMIN_CREDENTIAL = ("The operator's credential comes from SMB_ADMIN_TOKEN (or the file SMB_ADMIN_TOKEN_FILE "
                    "names), else it is derived from the shared secret (--secret-file or SMB_SECRET), as on "
                    "a memory-server host.")

def admin_options(p: argparse.ArgumentParser, drain: bool) -> None:
    """The options of ``smb server drain`` (``drain``) or undrain/remove besides the settings."""
    if drain:
        p.add_argument("--evacuate", action="store_true",
                       help="drain: also move every copy the server holds to other servers, and follow "
                            "the moves until it holds nothing")
        p.add_argument("--timeout", type=float, default=None,
                       help="drain --evacuate: stop following after this many seconds (exit 1; the moves go on)")
        p.add_argument("--quiet", action="store_true", help="drain --evacuate: no progress output")
    p.add_argument("--config", default=None, help=f"TOML file (default {DEFAULT_SERVER_FILE} if present)")


def admin_parser(action: str) -> argparse.ArgumentParser:
    """What ``smb server ACTION --help`` shows for drain, undrain and remove: the options
    that action reads, not the daemon's settings (parsing stays ``smb server``'s)."""
    what = {"drain": "The memory server takes no new extents; the regions it holds keep working "
                     "(--evacuate: every copy it holds moves to other servers)",
            "undrain": "A drained memory server takes new extents again",
            "remove": "Forget a drained memory server that holds nothing"}[action]
    p = argparse.ArgumentParser(prog=f"smb server {action}",
                                description=f"{what}. The server is the one --server-id names, else "
                                            "this host's configuration (server_id, or the id kept in "
                                            f"state_dir). {ADMIN_CREDENTIAL}")
    admin_options(p, action == "drain")
    add_setting_flags(p, ServerConfig, only=ADMIN_SETTINGS)
    return p


class ServerHelp(argparse.Action):
    """``smb server --help`` lists the daemon's settings; ``smb server drain --help``
    (undrain, remove) only what that action reads (:func:`admin_parser`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        action = getattr(namespace, "action", None)
        (admin_parser(action) if action in ADMIN_ACTIONS else parser).print_help()
        parser.exit()


def server_config(args: argparse.Namespace) -> ServerConfig:
    """This host's memory-server configuration (flags, SMB_* variables, file), no secret."""
    return load(ServerConfig, args.config, default_path=DEFAULT_SERVER_FILE,
                flags=setting_flags(args, ServerConfig), with_secret=False)


def run_admin(args: argparse.Namespace) -> int:
    """``smb server drain``: the server named by ``--server-id``, or else by this host's
    configuration, takes no new extents; the regions it holds keep working; with
    ``--evacuate`` every copy it holds moves to other servers while they do, and the
    command follows it until the server holds nothing. ``smb server undrain`` reverses
    a drain; ``smb server remove`` forgets a drained server that holds nothing."""
    client, server_id = pool.admin_client(server_config(args))
    with client as c:
        if args.action == "remove":
            s = c.remove_server(server_id)
            print(f"server {s.server_id} at {s.grpc_address} removed from the pool")
            return 0
        if args.action == "drain" and args.evacuate:
            return pool.evacuate(c, server_id, quiet=args.quiet, timeout=args.timeout)
        undrain = args.action == "undrain"
        s = c.drain_server(server_id, undrain=undrain)
    if undrain:
        print(f"server {s.server_id} at {s.grpc_address}: {s.state}; new extents may be placed on it")
    else:
        print(f"server {s.server_id} at {s.grpc_address}: {s.state}; no new extents go there, "
              f"its {s.extents} extent(s) ({format_bytes(s.used)}) keep serving")
    return 0



