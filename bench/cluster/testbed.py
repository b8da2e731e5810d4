"""A cluster on one machine: memory servers and workers on separate network hosts.

:class:`Testbed` builds, in network namespaces of its own (see :mod:`.netns`):

* a switch (``...-sw``): one bridge, no address;
* the controller's host (``...-ctl``, 198.18.0.1);
* ``servers`` memory-server hosts (``...-srv<i>``, 198.18.0.11, .12, ...);
* ``workers`` worker hosts (``...-wrk<j>``, 198.18.0.101, .102, ...), or, with
  ``colocate``, the workers on the memory-server hosts (a worker and a memory server
  per host, as in a cluster whose training nodes also lend their memory); ``colocate``
  a number ``c``: the first ``c`` workers on the first ``c`` memory-server hosts, the
  others on hosts of their own (some servers co-located, some dedicated);

every host joined to the bridge by its own veth link, capped at ``cap_mbit`` Mbit/s in
each direction. The addresses come from the RFC 2544 benchmarking range and exist only
inside these namespaces. Every daemon and worker runs inside its host's namespace
(``ip netns exec``, under ``setpriv --pdeathsig``), each host with its own
``SMB_HOST_ID``, so clients reach servers on other hosts over tcp through the bridge.
The controller has a host of its own: its link is capped like the others but carries
control traffic only.

Teardown (:meth:`Testbed.stop`, also from ``with``, from an ``atexit`` hook and, in the
command line, from SIGINT/SIGTERM/SIGHUP) kills the processes, deletes the namespaces
(which removes their links and the bridge) and the work directory. :func:`cleanup`
(``python -m bench.cluster --cleanup``) removes what a killed run left behind.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smb_server.commands.local_cluster import wait_for_json
from smb_server.commands.up import alive

from . import netns

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "198.18.0"           # a /24 of the RFC 2544 benchmarking range 198.18.0.0/15
PREFIXLEN = 24
CONTROLLER_PORT = 7700
START_TIMEOUT = 60.0          # seconds for a daemon to become ready
STOP_TIMEOUT = 5.0            # seconds between SIGTERM and SIGKILL
WORKER_TIMEOUT = 300.0        # seconds a worker run may take unless told otherwise
POLL = 0.05                   # seconds between looks at processes and files
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # held off during teardown

_counter = itertools.count()
_live: set[Testbed] = set()
_live_lock = threading.Lock()

# run a child under `setpriv --pdeathsig TERM` (util-linux) where it exists, so that the
# daemons die with the testbed even when it is killed outright
SETPRIV = shutil.which("setpriv")


Started = tuple[str, subprocess.Popen, Path]   # a worker's name, process and result path


class TestbedError(RuntimeError):
    """A daemon or worker failed; the message carries the tail of its log."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class Host:
    """One network host: a namespace, its address on the bridge and its switch port."""

    role: str        # ctl, srv<i>, wrk<j>
    ns: str
    address: str     # IPv4, no prefix length
    port: str        # name of its port on the bridge (inside the switch namespace)


class Testbed:
    """Owns its namespaces, processes and work directory; :meth:`stop` releases them.

    ``cap_mbit``: link rate in Mbit/s, each direction (0: no cap). ``lease_seconds``:
    the controller's server lease; ``heartbeat_seconds``: the servers' heartbeat period.
    ``capacity``: RAM each memory server offers (a size such as ``"1G"``).
    ``metrics_port``: where the controller and every memory server serve Prometheus
    ``/metrics`` on their own address (0: off; see :meth:`metrics_urls`).
    ``spares``: how many of the ``servers`` memory-server hosts (the last ones) are built
    without their daemon, for a server that joins later (:meth:`start_server`).
    """

    __test__ = False

    def __init__(self, servers: int, workers: int, *, cap_mbit: float = 200.0, colocate: bool | int = False,
                 lease_seconds: float = 3.0, heartbeat_seconds: float = 0.5, capacity: str = "1G",
                 log_level: str = "WARNING", workdir: str | None = None, keep_workdir: bool = False,
                 metrics_port: int = 0, spares: int = 0) -> None:
        if servers < 1 or workers < 0:
            raise ValueError("need at least one memory server and no negative worker count")
        shared = workers if colocate is True else int(colocate)
        if colocate is True and workers > servers:
            raise ValueError(f"colocate puts one worker per server host: {workers} workers > {servers} servers")
        if not 0 <= shared <= min(workers, servers):
            raise ValueError(f"colocate={colocate}: at most {min(workers, servers)} workers can share a "
                             "memory server's host")
        if not 0 <= spares < servers:
            raise ValueError(f"spares={spares}: at least one of the {servers} memory servers must start")
        self.num_servers = servers
        self.spares = spares
        self.num_workers = workers
        self.cap_mbit = cap_mbit
        self.colocate = shared > 0
        self.shared = shared     # workers on memory-server hosts (the first ones)
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.capacity = capacity
        self.log_level = log_level
        self.metrics_port = metrics_port
        self.tag = f"{netns.PREFIX}{os.getpid()}-{next(_counter)}"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"{netns.PREFIX}{os.getpid()}-"))
        self.keep_workdir = keep_workdir
        self.token = os.urandom(16).hex()
        self.switch = f"{self.tag}-sw"
        self.controller = Host("ctl", f"{self.tag}-ctl", f"{SUBNET}.1", "ctl")
        self.servers = [Host(f"srv{i}", f"{self.tag}-srv{i}", f"{SUBNET}.{11 + i}", f"srv{i}")
                        for i in range(servers)]
        self.workers = self.servers[:shared] + [
            Host(f"wrk{j}", f"{self.tag}-wrk{j}", f"{SUBNET}.{101 + j}", f"wrk{j}")
            for j in range(shared, workers)]
        self.controller_address = f"{self.controller.address}:{CONTROLLER_PORT}"
        self.server_info: list[dict[str, Any]] = []   # ready files: server_id, endpoints
        self._namespaces: list[str] = []
        self._procs: dict[str, subprocess.Popen] = {}
        self.state = "new"

    # -- lifecycle ----------------------------------------------------------------
    @property
    def hosts(self) -> list[Host]:
        return [self.controller, *self.servers, *self.workers[self.shared:]]

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Testbed:
        """Build the network, start the controller and the memory servers; returns once
        every memory server has registered."""
        self.state = "starting"
        with _live_lock:
            _live.add(self)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            (self.workdir / "logs").mkdir(exist_ok=True)
            self._build_network()
            self._start_daemons()
        except BaseException:
            self.stop()
            raise
        self.state = "running"
        log.info("testbed %s: %d memory servers, %d workers%s, links capped at %s", self.tag,
                 self.num_servers, self.num_workers, " (colocated)" if self.colocate else "",
                 f"{self.cap_mbit:g} Mbit/s" if self.cap_mbit else "no cap")
        return self

    def stop(self) -> None:
        """Kill every process, delete the namespaces and the work directory (idempotent)."""
        if self.state == "closed":
            return
        self.state = "closing"
        restore = {}
        held: list[int] = []
        if threading.current_thread() is threading.main_thread():
            # the teardown finishes first: a stop signal that comes meanwhile is held and
            # raised again after it (ignored, it was lost, and the run went on to its end)
            restore = {sig: signal.signal(sig, lambda got, _frame: held.append(got)) for sig in STOP_SIGNALS}
        try:
            procs = [p for p in self._procs.values() if p.poll() is None]
            for p in procs:
                _signal(p, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT
            for p in procs:
                try:
                    p.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal(p, signal.SIGKILL)
                    p.wait()
            for ns in reversed(self._namespaces):
                netns.delete_namespace(ns)
            self._namespaces.clear()
            if self._own_workdir and not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            for sig, handler in restore.items():
                signal.signal(sig, handler)
            with _live_lock:
                _live.discard(self)
            self.state = "closed"
        if held:
            signal.raise_signal(held[0])

    # -- network ------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        # noted before it is made: an interrupt (SIGINT) that lands after `ip netns add`
        # still finds it in the list stop() deletes (deleting one never made is harmless)
        self._namespaces.append(name)
        netns.add_namespace(name)

    def _build_network(self) -> None:
        self._add_ns(self.switch)
        netns.add_bridge(self.switch)
        for host in self.hosts:
            self._add_ns(host.ns)
            netns.add_host_link(self.switch, host.port, host.ns, f"{host.address}/{PREFIXLEN}")
            self._cap(host)

    def _cap(self, host: Host) -> None:
        if self.cap_mbit:
            netns.set_cap(host.ns, netns.HOST_IF, self.cap_mbit)       # what the host sends
            netns.set_cap(self.switch, host.port, self.cap_mbit)       # what it receives

    def qdiscs(self, host: Host) -> dict[str, str]:
        """``tc qdisc show`` of both ends of ``host``'s link (``host`` and ``switch``)."""
        return {"host": netns.qdisc(host.ns, netns.HOST_IF),
                "switch": netns.qdisc(self.switch, host.port)}

    def link_bytes(self, host: Host) -> dict[str, int]:
        """Bytes through ``host``'s link as its switch port counts them: ``to_host``
        and ``from_host``."""
        b = netns.link_bytes(self.switch, host.port)
        return {"to_host": b["tx"], "from_host": b["rx"]}

    def link_down(self, host: Host) -> None:
        """Take ``host``'s link down (``ip link set eth0 down`` in its namespace)."""
        netns.set_link(host.ns, netns.HOST_IF, False)
        log.info("link of %s (%s) down", host.role, host.address)

    def link_up(self, host: Host) -> None:
        """Bring ``host``'s link back, with its cap."""
        netns.set_link(host.ns, netns.HOST_IF, True)
        self._cap(host)
        log.info("link of %s (%s) up", host.role, host.address)

    # -- processes ----------------------------------------------------------------
    def _env(self, host: Host, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
        env.update(SMB_TOKEN=self.token, SMB_HOST_ID=host.ns, PYTHONPATH=str(ROOT),
                   PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=netns.HOST_IF)
        env.update(extra or {})
        return env

    def spawn(self, host: Host, name: str, argv: Sequence[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run ``python argv...`` inside ``host``'s namespace; output goes to
        ``logs/<name>.log`` in the work directory. The testbed owns the process."""
        if name in self._procs and self._procs[name].poll() is None:
            raise TestbedError(f"a process named {name} is still running")
        cmd = [netns.IP, "netns", "exec", host.ns, sys.executable, *argv]
        if SETPRIV:
            cmd = [SETPRIV, "--pdeathsig", "TERM", *cmd]
        with open(self.log_path(name), "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=ROOT, env=self._env(host, env), start_new_session=True)
        self._procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    @contextmanager
    def monitor_links(self, path: Path, interval: float = 0.02) -> Iterator[list[Host]]:
        """Sample every server's and worker's link (:mod:`.linkmon`, in the switch's
        namespace) into ``path`` while the block runs; yields the hosts sampled."""
        hosts = [h for h in self.hosts if h is not self.controller]
        proc = self.spawn(Host("switch", self.switch, "", ""), f"linkmon-{path.stem}",
                          ["-m", "bench.cluster.linkmon", "--ports", ",".join(h.port for h in hosts),
                           "--interval", str(interval), "--out", str(path)])
        try:
            yield hosts
        finally:
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stacks(self, name: str, proc: subprocess.Popen, timeout: float = 5.0) -> str:
        """Every thread's Python stack of the running process ``name`` (a worker, which
        registers faulthandler for SIGUSR1): the signal, then what it wrote to its log once
        the log stops growing; empty if it wrote nothing within ``timeout`` seconds."""
        path = self.log_path(name)
        before = path.stat().st_size if path.exists() else 0
        _signal(proc, signal.SIGUSR1)
        deadline, size, since = time.monotonic() + timeout, before, time.monotonic()
        while time.monotonic() < deadline:
            now = path.stat().st_size if path.exists() else 0
            if now != size:
                size, since = now, time.monotonic()
            elif size > before and time.monotonic() - since > 0.3:
                break
            time.sleep(POLL)
        with open(path, "rb") as f:
            f.seek(before)
            return f.read().decode(errors="replace").rstrip()

    def pid(self, name: str) -> int:
        return self._procs[name].pid

    def _wait_ready(self, path: Path, name: str, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        proc = self._procs[name]
        try:
            return wait_for_json(path, timeout, proc, POLL)
        except ChildProcessError:
            raise TestbedError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}") from None
        except TimeoutError:
            raise TestbedError(f"{name} not ready after {timeout:.0f} s:\n{self.log_tail(name)}") from None

    def _daemon(self, host: Host, name: str, args: list[str]) -> None:
        self.spawn(host, name, ["-m", "smb_server.commands.cli", "--log-level", self.log_level, *args])

    def _start_daemons(self) -> None:
        secret = self.workdir / "secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        ready = self.workdir / "controller.ready"
        self._daemon(self.controller, "controller", [
            "controller", "--listen", self.controller_address, "--db", str(self.workdir / "controller.db"),
            "--secret-file", str(secret), "--ready-file", str(ready),
            "--lease", str(self.lease_seconds), "--orphan-grace", "60", *self._metrics_args()])
        self._wait_ready(ready, "controller")
        started = self.num_servers - self.spares
        for i in range(started):
            self._spawn_server(i)
        self.server_info = [self._wait_ready(self.workdir / f"srv{i}" / "ready", f"srv{i}")
                            for i in range(started)]

    def _spawn_server(self, i: int) -> None:
        host = self.servers[i]
        state = self.workdir / f"srv{i}"
        state.mkdir(exist_ok=True)
        self._daemon(host, f"srv{i}", [
            "server", "--controller", self.controller_address, "--listen-host", host.address,
            "--advertise-host", host.address, "--capacity", self.capacity,
            "--state-dir", str(state), "--secret-file", str(self.workdir / "secret"),
            "--ready-file", str(state / "ready"), "--transports", "tcp,shm" if self.colocate else "tcp",
            "--heartbeat", str(self.heartbeat_seconds), *self._metrics_args()])

    def start_server(self, index: int) -> dict[str, Any]:
        """Start the memory server of spare host ``index`` (the next one not started
        yet); returns its ready file (``server_id``, endpoints) once it registered."""
        if index != len(self.server_info):
            raise ValueError(f"memory server {index}: the next one to start is {len(self.server_info)}")
        self._spawn_server(index)
        info = self._wait_ready(self.workdir / f"srv{index}" / "ready", f"srv{index}")
        self.server_info.append(info)
        log.info("memory server srv%d (%s) joined", index, info.get("server_id"))
        return info

    def _metrics_args(self) -> list[str]:
        return ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []

    def metrics_urls(self) -> dict[str, str]:
        """``/metrics`` of the controller (``ctl``) and of every memory server
        (``srv<i>``), reachable from any host of the testbed; empty without ``metrics_port``."""
        if not self.metrics_port:
            return {}
        return {h.role: f"http://{h.address}:{self.metrics_port}/metrics"
                for h in (self.controller, *self.servers)}

    def kill_server(self, index: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` (default SIGKILL, as ``kill -9``) to memory server ``index``;
        returns the ``time.time()`` it was sent. The process is reaped; its host and
        link stay."""
        proc = self._procs[f"srv{index}"]
        when = time.time()
        _signal(proc, sig)
        proc.wait(STOP_TIMEOUT)
        log.info("memory server srv%d (pid %d) killed with signal %d", index, proc.pid, sig)
        return when

    def server_host(self, server_id: str) -> Host:
        """The host of the memory server with id ``server_id``."""
        # server_info stays empty until start() has seen every server ready
        for host, info in zip(self.servers, self.server_info, strict=False):
            if info["server_id"] == server_id:
                return host
        raise KeyError(f"no memory server {server_id} in this testbed")

    # -- workers ------------------------------------------------------------------
    def start_worker(self, host: Host, name: str, spec: dict[str, Any]) -> tuple[subprocess.Popen, Path]:
        """Start ``bench.cluster.worker`` on ``host`` with ``spec`` (JSON); returns the
        process and the path its result will be written to."""
        spec = dict(spec, controller=self.controller_address, address=host.address, host=host.role)
        spec_path = self.workdir / f"{name}.spec.json"
        out_path = self.workdir / f"{name}.out.json"
        out_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps(spec))
        proc = self.spawn(host, name, ["-m", "bench.cluster.worker", str(spec_path), str(out_path)])
        return proc, out_path

    def wait_worker(self, name: str, proc: subprocess.Popen, out: Path, timeout: float) -> dict[str, Any]:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()
            raise TestbedError(f"{name} still running after {timeout:.0f} s:\n{self.log_tail(name)}") from None
        return self._result(name, proc, out)

    def _result(self, name: str, proc: subprocess.Popen, out: Path) -> dict[str, Any]:
        if proc.returncode != 0 or not out.exists():
            raise TestbedError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
        return json.loads(out.read_text())

    def run_workers(self, specs: Sequence[dict[str, Any]], *, hosts: Sequence[Host] | None = None,
                    timeout: float = WORKER_TIMEOUT, name: str = "worker",
                    watch: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Run one worker per spec (spec ``i`` on ``hosts[i]``, default the worker
        hosts) and return their results in order. When one fails, the others are killed
        and TestbedError carries the failed one's log; all are killed after ``timeout``
        seconds. ``watch`` is called at every look at the workers (for progress), and
        once more after they all finished."""
        hosts = list(hosts or self.workers)
        if len(specs) > len(hosts):
            raise ValueError(f"{len(specs)} workers, {len(hosts)} hosts")
        runs = []
        try:
            for i, spec in enumerate(specs):
                runs.append((f"{name}{i}", *self.start_worker(hosts[i], f"{name}{i}", spec)))
            deadline = time.monotonic() + timeout
            while True:
                failed = [(n, p) for n, p, _ in runs if p.poll() not in (None, 0)]
                if failed:
                    n, p = failed[0]
                    raise TestbedError(f"{n} on {hosts[int(n[len(name):])].role} exited with "
                                       f"{p.returncode}:\n{self.log_tail(n)}")
                if all(p.poll() == 0 for _, p, _ in runs):
                    if watch is not None:
                        watch()
                    return [self._result(n, p, o) for n, p, o in runs]
                if time.monotonic() > deadline:
                    raise TestbedError(f"workers still running after {timeout:.0f} s:\n"
                                       + self.log_tail(runs[0][0]))
                if watch is not None:
                    watch()
                time.sleep(POLL)
        finally:
            for _, p, _ in runs:
                kill_process(p)

    def watch_workers(self, workers: Sequence[Started], timeout: float,
                      look: Callable[[], str | None] = lambda: None,
                      tail: int = 15) -> tuple[list[dict[str, Any]], str | None]:
        """Look at ``workers`` (as :meth:`start_worker` started them, with their names)
        every ``POLL`` seconds until every one exited 0, one failed, ``look`` (the
        experiment's own step, first at every look) returned an error or ``timeout``
        seconds passed; then kill those still running. Returns the results of the
        workers that finished and the error (None: none), a failed worker's with the
        last ``tail`` lines of its log; after ``timeout``, every worker still running is
        named with the end of its log and every thread's stack (:meth:`stacks`)."""
        deadline = time.monotonic() + timeout
        error = None
        try:
            while True:
                error = look()
                if error is not None:
                    break
                failed = [(n, p) for n, p, _ in workers if p.poll() not in (None, 0)]
                if failed:
                    n, p = failed[0]
                    error = f"{n} exited with {p.returncode}:\n{self.log_tail(n, tail)}"
                    break
                if all(p.poll() == 0 for _, p, _ in workers):
                    break
                if time.monotonic() > deadline:
                    stuck = [(n, p) for n, p, _ in workers if p.poll() is None]
                    error = f"workers still running after {timeout:.0f} s: " + ", ".join(n for n, _ in stuck)
                    for n, p in stuck:
                        error += (f"\n{n}, its log's end:\n{self.log_tail(n, tail)}"
                                  f"\n{n}, its threads:\n{self.stacks(n, p)}")
                    break
                time.sleep(POLL)
        finally:
            for _, p, _ in workers:
                kill_process(p)
        return [json.loads(out.read_text()) for _, p, out in workers if p.returncode == 0 and out.exists()], error

    def list_servers(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The controller's view of the memory servers (asked from the controller's host)."""
        return self.run_workers([{"mode": "probe"}], hosts=[self.controller], timeout=timeout,
                                name="probe")[0]["servers"]


def cleanup(force: bool = False) -> list[str]:
    """Remove what killed runs left behind: their namespaces (see :func:`netns.cleanup`)
    and their work directories (``$TMPDIR/smbc-<pid>-*``). Returns what was removed."""
    removed = netns.cleanup(force)
    for path in Path(tempfile.gettempdir()).glob(f"{netns.PREFIX}*"):
        pid = netns.owner_pid(path.name)
        if path.is_dir() and pid is not None and (force or not alive(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def live_pids() -> dict[int, str]:
    """Processes (daemons, workers) of every running testbed of this process, with their
    roles: ``servers`` (memory servers), ``control`` (the controller), ``monitor``
    (link samplers) or ``workers`` (everything else the testbed runs)."""
    with _live_lock:
        beds = list(_live)
    return {p.pid: _role(name) for bed in beds for name, p in list(bed._procs.items()) if p.poll() is None}


def _role(name: str) -> str:
    for prefix, role in (("srv", "servers"), ("controller", "control"), ("linkmon", "monitor")):
        if name.startswith(prefix):
            return role
    return "workers"


def kill_process(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` if it still runs, and reap it."""
    if proc.poll() is None:
        _signal(proc, signal.SIGKILL)
        proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


@atexit.register
def _stop_all() -> None:
    """Tear down testbeds still running at interpreter exit."""
    with _live_lock:
        beds = list(_live)
    for bed in beds:
        try:
            bed.stop()
        except Exception:  # keep tearing down the others
            log.exception("teardown of %s failed", bed.tag)
