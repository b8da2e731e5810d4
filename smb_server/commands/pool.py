"""Changing the pool under running jobs: ``smb server drain --evacuate``, ``smb server
remove`` and ``smb rebalance``.

Both long commands ask the controller to move copies (:mod:`smb_server.controller.moves`)
and then follow it: bytes moved, bytes left and the rate, as a bar on a terminal and as
a line every few seconds otherwise. They return when nothing is left to move; an
interrupted command leaves the moves running (an evacuation is the server's stored drain
flag; ``smb rebalance --stop`` ends a rebalance). Every call is retried across a
controller failover by the client, so the command follows the new leader.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from smb_client import Client
from smb_protocol.tls import TLSConfig
from smb_protocol.units import format_bytes
from smb_server.runtime.config import ServerConfig

from .tokens import admin_token

POLL_SECONDS = 0.5          # between two looks at the controller
LINE_SECONDS = 5.0          # between two progress lines when stdout is no terminal
STALLED_SECONDS = 30.0      # without progress before the command says what a move needs


class Progress:
    """Bytes moved out of ``total``: a tqdm bar on a terminal, else a line every
    :data:`LINE_SECONDS` seconds (and one at the end)."""

    def __init__(self, what: str, total: int, quiet: bool = False) -> None:
        self.what, self.total, self.quiet = what, total, quiet
        self.start = time.monotonic()
        self._last_line = 0.0
        self._bar = None
        if not quiet and sys.stdout.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024)

    def show(self, done: int, detail: str = "") -> None:
        """``done`` bytes moved so far."""
        if self._bar is not None:
            self._bar.total = max(self.total, done)
            self._bar.n = done
            self._bar.set_postfix_str(detail, refresh=False)
            self._bar.refresh()
            return
        now = time.monotonic()
        if not self.quiet and now - self._last_line >= LINE_SECONDS:
            self._last_line = now
            self._line(done, detail)

    def _line(self, done: int, detail: str) -> None:
        rate = done / max(time.monotonic() - self.start, 1e-9)
        print(f"{self.what}: {format_bytes(done)} moved, {format_bytes(max(0, self.total - done))} left, "
              f"{format_bytes(int(rate))}/s{', ' + detail if detail else ''}", flush=True)

    def close(self, done: int, detail: str = "") -> None:
        if self._bar is not None:
            self.show(done, detail)
            self._bar.close()
        elif not self.quiet:
            self._line(done, detail)


def follow(poll: Callable[[], tuple[bool, int, int, str]], what: str, quiet: bool = False,
           timeout: float | None = None) -> bool:
    """Poll ``poll() -> (done, bytes moved, bytes left, detail)`` until done (True) or
    ``timeout`` seconds passed (False), showing progress."""
    finished, moved, left, detail = poll()
    bar = Progress(what, moved + left, quiet)
    deadline = None if timeout is None else time.monotonic() + timeout
    last_change, said = time.monotonic(), False
    while not finished:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            bar.close(moved, detail)
            return False
        if now - last_change > STALLED_SECONDS and not said:
            said = True
            print(f"{what}: nothing moved for {STALLED_SECONDS:g} s: a copy needs a server that is up, not "
                  "draining, with room and no copy of its slot (`smb status`; the controller's log names "
                  "the slot)", file=sys.stderr, flush=True)
        bar.total = max(bar.total, moved + left)
        bar.show(moved, detail)
        time.sleep(POLL_SECONDS)
        before = moved
        finished, moved, left, detail = poll()
        if moved != before:
            last_change = time.monotonic()
    bar.close(moved, detail)
    return True


def evacuate(c: Client, server_id: str, quiet: bool = False, timeout: float | None = None) -> int:
    """Drain ``server_id`` with ``evacuate`` and follow it until it holds nothing;
    exit status 0, or 1 after ``timeout``."""
    s = c.drain_server(server_id, evacuate=True)
    first = s.used

    def poll() -> tuple[bool, int, int, str]:
        now = next(x for x in c.list_servers() if x.server_id == server_id)
        return now.extents == 0, max(0, first - now.used), now.used, f"{now.extents} extent(s) left"
    if not follow(poll, f"evacuating {server_id}", quiet, timeout):
        print(f"server {server_id}: still holds extents after {timeout:g} s; the moves go on "
              f"(`smb status` shows them)", file=sys.stderr)
        return 1
    print(f"server {server_id} holds nothing now ({format_bytes(first)} moved); "
          f"`smb server remove --server-id {server_id}` takes it out of the pool")
    return 0


def rebalance(c: Client, bytes_per_second: float, quiet: bool = False, timeout: float | None = None) -> int:
    """Start a rebalance and follow it until done; exit status 0, or 1 after ``timeout``."""
    first = c.rebalance(bytes_per_second)
    base = first.bytes_moved

    def poll() -> tuple[bool, int, int, str]:
        r = c.rebalance(bytes_per_second)
        return not r.running, r.bytes_moved - base, r.bytes_left, ""
    if not follow(poll, "rebalancing", quiet, timeout):
        print(f"the rebalance goes on after {timeout:g} s (`smb rebalance --stop` ends it)", file=sys.stderr)
        return 1
    shares = ", ".join(f"{s.server_id} {format_bytes(s.used)}" for s in c.list_servers() if s.state == "up")
    print(f"balanced: {shares}")
    return 0


def admin_client(cfg: ServerConfig, server: bool = True) -> tuple[Client, str]:
    """An admin client from a memory-server configuration ``cfg``, reaching the
    controller as that server does (its TLS files), and the server id ``cfg`` names (its
    ``server_id``, or the id kept in its ``state_dir``; "" without ``server``)."""
    from smb_server.memserver.main import read_server_id
    server_id = (cfg.server_id or read_server_id(cfg.state_dir)) if server else ""
    tls = TLSConfig(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
    return Client(cfg.controller, admin_token(cfg.secret_file) or cfg.token, tls=tls), server_id


def cmd_rebalance(args: argparse.Namespace, cfg: ServerConfig) -> int:
    """``smb rebalance``: start (or stop) a rebalance and follow it."""
    client, _ = admin_client(cfg, server=False)
    with client as c:
        if args.stop:
            r = c.rebalance(stop=True)
            print(f"rebalance stopped ({format_bytes(r.bytes_moved)} moved; a copy in flight finishes)")
            return 0
        return rebalance(c, args.rate, quiet=args.quiet, timeout=args.timeout)


def add_parser(sub: Any, default_file: str, run: Callable[[argparse.Namespace], int]) -> None:
    """``smb rebalance``, run by ``run``."""
    p = sub.add_parser("rebalance", help="move copies online until every up server holds an even share",
                       description="Moves copies of regions (online, exactly once) from the fullest "
                                   "memory servers to the emptiest, e.g. after servers joined, and "
                                   "follows the moves until done. Admin credential and controller as "
                                   "for `smb server drain` (this host's server configuration, "
                                   "SMB_CONTROLLER, SMB_ADMIN_TOKEN).")
    p.add_argument("--config", default=None, help=f"TOML file (default {default_file} if present)")
    p.add_argument("--controller", default=None, help="controller host:port (default $SMB_CONTROLLER)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="average bytes per second the moves may copy (default 0: no limit)")
    p.add_argument("--stop", action="store_true", help="start no more moves (the one copying finishes)")
    p.add_argument("--timeout", type=float, default=None, help="give up following after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(fn=run)
