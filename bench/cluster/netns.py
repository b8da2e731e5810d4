"""Network namespaces, veth links on a bridge and link caps: the plumbing of the testbed.

Everything goes through iproute2 (``ip``, ``tc``) and lives inside namespaces this
module creates, so nothing is added to the initial namespace of the machine (no
address, no route, no link): parallel runs cannot clash, and removing the namespaces
removes every link. Names:

* every namespace of one testbed is ``smbc-<pid>-<role>`` (``pid`` of the process
  that built it); :func:`cleanup` removes leftovers by that prefix;
* the switch namespace (``...-sw``) holds the bridge ``br0`` and one port per host
  (named after the host's role); each host namespace sees its end of the link as
  ``eth0``.

A link cap is a token bucket (``tbf``) on the egress of *both* ends of a host's veth
pair: the host's end limits what it sends, the switch's end what it receives.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time

from smb_server.commands.up import alive

log = logging.getLogger(__name__)

PREFIX = "smbc-"            # every namespace this module creates starts with it
BRIDGE = "br0"              # the bridge, inside the switch namespace
HOST_IF = "eth0"            # a host's end of its link, inside its namespace
CMD_TIMEOUT = 20.0          # seconds one ip/tc command may take
TBF_BURST = "128kb"         # bucket size: above one 64 KiB GSO packet, ~5 ms at 200 Mbit/s
# longest a packet may wait in the bucket's queue (SMB_BENCH_TBF_LATENCY: another bound,
# e.g. "5ms", to see what the queue adds to small requests behind bulk transfers)
TBF_LATENCY = os.environ.get("SMB_BENCH_TBF_LATENCY", "50ms")


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message has the command and its stderr."""


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


IP = _tool("ip")
TC = _tool("tc")


def run(cmd: list[str], check: bool = True, timeout: float = CMD_TIMEOUT) -> str:
    """Run one command; returns stdout. Raises NetnsError when it fails and ``check``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(cmd)}: {exc}") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (not root, no ``ip``/``tc``, no netns
    support), or None when they can. Probes by creating and deleting a namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in (IP, TC):
        if not os.access(tool, os.X_OK):
            return f"{tool} not found (install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:   # made inside the try: an interrupt that lands after `ip netns add` still deletes it
        try:
            run([IP, "netns", "add", probe])
        except NetnsError as exc:
            return f"cannot create a network namespace: {exc}"
        run([IP, "-n", probe, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"])
        run([TC, "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit",
             "burst", TBF_BURST, "latency", TBF_LATENCY])
    except NetnsError as exc:
        return f"veth or tbf unavailable: {exc}"
    finally:
        run([IP, "netns", "delete", probe], check=False)
    return None


# -- namespaces ---------------------------------------------------------------------
def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = run([IP, "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def add_namespace(name: str) -> None:
    run([IP, "netns", "add", name])
    run([IP, "-n", name, "link", "set", "lo", "up"])


def namespace_pids(name: str) -> list[int]:
    out = run([IP, "netns", "pids", name], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def identify(pid: int) -> str:
    """The name of the namespace process ``pid`` runs in ('' for the initial one)."""
    return run([IP, "netns", "identify", str(pid)], check=False).strip()


def delete_namespace(name: str, kill_timeout: float = 5.0) -> None:
    """Kill what still runs in namespace ``name`` (SIGKILL) and delete it."""
    pids = namespace_pids(name)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + kill_timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if alive(p)]
        time.sleep(0.05)
    run([IP, "netns", "delete", name], check=False)


def owner_pid(name: str) -> int | None:
    """The pid in ``smbc-<pid>-<role>``, or None for a name of another shape."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def cleanup(force: bool = False) -> list[str]:
    """Remove leftover testbed namespaces (and with them their links and bridges).

    Namespaces whose owning process is still alive belong to a running testbed and
    are kept unless ``force``. Returns the names removed.
    """
    removed = []
    for name in list_namespaces():
        pid = owner_pid(name)
        if not force and pid is not None and alive(pid):
            log.info("keeping %s: process %d is still running", name, pid)
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


# -- links --------------------------------------------------------------------------
def add_bridge(switch_ns: str) -> None:
    run([IP, "-n", switch_ns, "link", "add", "name", BRIDGE, "type", "bridge", "stp_state", "0"])
    run([IP, "-n", switch_ns, "link", "set", BRIDGE, "up"])


def add_host_link(switch_ns: str, port: str, host_ns: str, address: str) -> None:
    """A veth pair from the bridge (port ``port``) to ``host_ns`` (``eth0`` with
    ``address``, e.g. ``198.18.0.11/24``), both ends up."""
    run([IP, "-n", switch_ns, "link", "add", "name", port, "type", "veth",
         "peer", "name", HOST_IF, "netns", host_ns])
    run([IP, "-n", switch_ns, "link", "set", port, "master", BRIDGE])
    run([IP, "-n", switch_ns, "link", "set", port, "up"])
    run([IP, "-n", host_ns, "addr", "add", address, "dev", HOST_IF])
    run([IP, "-n", host_ns, "link", "set", HOST_IF, "up"])


def set_cap(ns: str, dev: str, mbit: float) -> None:
    """Limit the egress of ``dev`` in ``ns`` to ``mbit`` Mbit/s (token bucket)."""
    run([TC, "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
         "burst", TBF_BURST, "latency", TBF_LATENCY])


def qdisc(ns: str, dev: str) -> str:
    """``tc qdisc show`` of ``dev`` in ``ns``."""
    return run([TC, "-n", ns, "qdisc", "show", "dev", dev]).strip()


def set_link(ns: str, dev: str, up: bool) -> None:
    run([IP, "-n", ns, "link", "set", dev, "up" if up else "down"])


def link_bytes(ns: str, dev: str) -> dict[str, int]:
    """Byte counters of ``dev`` in ``ns``: ``{"rx": ..., "tx": ...}``."""
    info = json.loads(run([IP, "-n", ns, "-s", "-j", "link", "show", "dev", dev]))[0]
    stats = info["stats64"]
    return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}
