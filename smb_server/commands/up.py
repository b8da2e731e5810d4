"""``smb up`` and ``smb down``: a local cluster in the foreground, and stopping it from
another shell.

``smb up`` writes a *pid file*, a JSON document ``{"pid", "address", "workdir"}``: by
default :func:`default_pid_file` of the controller's port (``smb-up-<uid>-<port>.pid``
in the temporary directory), and always ``up.json`` in its work directory. ``smb down``
reads one of them (``--port``, ``--pid-file`` or ``--workdir``), sends that ``smb up``
SIGTERM and waits until it has stopped its daemons. The cluster's token is
``$SMB_TOKEN`` when set, else the one of ``--env-file`` when that file exists, else a
new one; ``--env-file`` is (re)written with the lines clients need.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from smb_protocol.units import format_bytes

from .local_cluster import STOP_TIMEOUT, ClusterError, LocalCluster

log = logging.getLogger(__name__)

DEFAULT_PORT = 7700
STATE_FILE = "up.json"          # in the work directory of an `smb up`
DOWN_GRACE = 10.0               # seconds `smb down` waits beyond the daemons' stop timeout


def default_pid_file(port: int) -> Path:
    """Where ``smb up`` on controller ``port`` writes its pid file unless told otherwise."""
    return Path(tempfile.gettempdir()) / f"smb-up-{os.getuid()}-{port}.pid"


def read_env_token(path: str) -> str:
    """``SMB_TOKEN`` of an env file (``export SMB_TOKEN=...`` or ``SMB_TOKEN=...``
    lines); "" when the file does not exist or names none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise ClusterError(f"cannot read the env file {path}: {exc.strerror}; fix its permissions "
                           "or pass another --env-file") from None
    for line in text.splitlines():
        key, _, value = line.strip().removeprefix("export ").partition("=")
        if key.strip() == "SMB_TOKEN" and value.strip():
            return value.strip().strip("'\"")
    return ""


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def cmd_up(args: argparse.Namespace) -> int:
    token, source = os.environ.get("SMB_TOKEN", ""), "SMB_TOKEN"
    if not token and args.env_file:
        token, source = read_env_token(args.env_file), args.env_file
    cluster = LocalCluster(args.memory_servers, args.capacity, workdir=args.workdir,
                           controller_port=args.port, tls=args.tls,
                           tls_client_auth=args.tls_client_auth, metrics=args.metrics,
                           token=token or None)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster.start()
    port = int(cluster.address.rpartition(":")[2])
    pid_file = Path(args.pid_file) if args.pid_file else default_pid_file(port)
    state = json.dumps({"pid": os.getpid(), "address": cluster.address, "workdir": str(cluster.workdir)})
    written = [pid_file, cluster.workdir / STATE_FILE]
    try:
        # the env file first: the pid file says the cluster is ready, so whoever sees it
        # (`smb down`, a script, a user's `source`) finds the env file already written
        if args.env_file:
            _write_private(Path(args.env_file), cluster.describe())
        for path in written:
            _write_private(path, state + "\n")
        print(f"Soft Memory Box: controller at {cluster.address}, {args.memory_servers} memory servers "
              f"of {format_bytes(cluster.capacity)} (logs in {cluster.workdir})")
        if args.metrics:
            print("metrics: `smb status --metrics` reads each memory server's /metrics")
        how = (f"the token of {source}" if token else "new credentials for this cluster") + "; keep them private"
        print(f"Use it from another shell with ({how}):\n" + cluster.describe()
              + (f"(also in {args.env_file}: `source {args.env_file}`)\n" if args.env_file else "")
              + f"Stop it with Ctrl-C here, or `smb down --pid-file {pid_file}`.", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        print("stopping local cluster", flush=True)
        cluster.stop()
        for path in written:
            _remove_if_ours(path)
    return 0


def _remove_if_ours(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not); True
    where /proc cannot tell (the signal check found it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def _is_smb_up(pid: int) -> bool:
    """Whether ``pid`` is an ``smb up`` (and not another process that got the pid of
    one that ended); True where /proc cannot tell."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return b"up" in argv


def cmd_down(args: argparse.Namespace) -> int:
    if args.pid_file:
        path = Path(args.pid_file)
    elif args.workdir:
        path = Path(args.workdir) / STATE_FILE
    else:
        path = default_pid_file(args.port)
    try:
        state: dict[str, Any] = json.loads(path.read_text())
        pid = int(state["pid"])
    except FileNotFoundError:
        raise ClusterError(f"no local cluster found: {path} does not exist; name the cluster "
                           "`smb up` started with --port PORT, --pid-file FILE or --workdir DIR "
                           "(its `smb up` printed the pid file)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"{path} is not a pid file of `smb up` ({exc}); remove it, or name "
                           "another with --pid-file") from None
    where = state.get("address", "?")
    if not alive(pid) or not _is_smb_up(pid):
        path.unlink(missing_ok=True)
        print(f"the local cluster at {where} is not running (pid {pid} is gone); removed {path}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT + DOWN_GRACE
    while alive(pid) and path.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"`smb up` (pid {pid}) still runs {STOP_TIMEOUT + DOWN_GRACE:g} s "
                               f"after SIGTERM; see its output, or end it with `kill -9 {pid}`")
        time.sleep(0.05)
    print(f"stopped the local cluster at {where} (pid {pid})")
    return 0


def add_parsers(sub: Any) -> None:
    """The ``up`` and ``down`` subcommands on ``sub`` (the ``smb`` subparsers)."""
    p = sub.add_parser(
        "up", help="run a local cluster (controller + memory servers) in the foreground",
        description="Starts a controller and memory servers on this host (loopback), prints "
                    "the SMB_CONTROLLER and SMB_TOKEN lines clients need and runs until Ctrl-C, "
                    "SIGTERM or `smb down`. The token is $SMB_TOKEN when set, else that of "
                    "--env-file when the file exists, else a new one. Writes a pid file "
                    "(--pid-file; `smb down` reads it) and up.json in the work directory.")
    p.add_argument("--memory-servers", "--servers", dest="memory_servers", type=int, default=2,
                   help="memory servers to start (default 2)")
    p.add_argument("--capacity", default="1G", help="RAM each memory server offers (default 1G)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="controller port (default 7700; 0: any)")
    p.add_argument("--workdir", default=None, help="logs, state and database (default: a new temporary one)")
    p.add_argument("--tls", action="store_true",
                   help="serve gRPC and the TCP data plane over TLS with a throw-away CA made in "
                        "the work directory (tls/); prints the SMB_TLS_* lines clients need")
    p.add_argument("--tls-client-auth", action="store_true",
                   help="like --tls, and refuse clients without a certificate of that CA")
    p.add_argument("--metrics", action="store_true",
                   help="every daemon serves Prometheus /metrics on a free loopback port "
                        "(`smb status --metrics` shows the memory servers' latencies)")
    p.add_argument("--env-file", default=None,
                   help="take SMB_TOKEN from this file when it exists (unless SMB_TOKEN is set) "
                        "and write the export lines there (mode 0600) for `source FILE`")
    p.add_argument("--pid-file", default=None,
                   help="where to write the pid file `smb down` reads "
                        "(default: smb-up-UID-PORT.pid in the temporary directory)")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser(
        "down", help="stop a local cluster that `smb up` started",
        description="Sends the `smb up` named by its pid file SIGTERM and waits until it has "
                    "stopped its daemons. The pid file: --pid-file, or up.json in --workdir, "
                    "or the default of --port (7700). A pid file whose process is gone is removed.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="the controller port of the `smb up` (default 7700)")
    p.add_argument("--pid-file", default=None, help="the pid file `smb up` wrote")
    p.add_argument("--workdir", default=None, help="the work directory of the `smb up` (its up.json)")
    p.set_defaults(fn=cmd_down)
