"""The soak: a mixed workload on a real local cluster, with faults on a schedule, and
invariants checked while it runs and at the end.

    .venv/bin/python -m bench.soak --minutes 30            # results in bench/results/soak.*
    .venv/bin/python -m bench.soak --minutes 1 --plot docs/img/soak.png

The cluster: one etcd member (``smb_server/testing/etcd.py``), two controllers on it (one
leads, one stands by; ``smb_server/testing/controllers.py``) and three
memory servers with the tcp and shm planes and a ``data_dir`` each, every one its own
process on 127.0.0.1. Nothing leaves loopback.

The load, for ``--minutes`` (every operation bounded by the client's timeouts):

* data workers, one thread and one client each: tcp and shm, unreplicated and
  ``replicas=2``, and a persistent region over tcp; each owns a few regions (256 KiB,
  ``single`` or ``striped``) with a shadow copy and runs writes, reads (compared byte by
  byte with the shadow), int64 accumulates, ``fetch_add`` and ``compare_swap`` on the
  region's first 4 KiB (single writer: an atomic's old value must be the shadow's),
  and now and then deletes a region and creates it again under the same name (the old
  handle must then raise ``RegionNotFound`` and the new region read zeros);
* every data worker also adds to shared counters (a ``replicas=2`` region all of them
  use: ``fetch_add`` and ``accumulate``): at the end each word must equal the
  acknowledged increments, plus at most those whose call raised (outcome unknown);
* three parties (threads, a client each) run ``Collective.all_reduce`` on int64 data in
  blocks of rounds; every sum must be exact. A collective whose region was on a killed
  server fails with a typed error; the group then builds a new one.

Faults, every ``--fault-every`` seconds (default a third of the run, 20 to 90 s), taking
turns, each only once the cluster is healthy again (every server up, no region
degraded): a memory server gets SIGKILL and is started again with its state directory
(the restart waits 0.5 s or 5 s, by turns: before or after its lease runs out), or the
leading controller gets SIGKILL, a standby takes over and the killed one comes back as
a standby.

Invariants (a violation makes the exit status 1):

* every acknowledged write reads back, byte for byte (during the run and at the end);
* arithmetic is applied exactly once: an atomic's old value, a counter's final value;
  an operation that raised may have taken effect or not, never twice or partly;
* collective sums are exact;
* no region is lost unless it was unreplicated, memory-only and on a killed server; no
  region stays degraded once the cluster has recovered; every acknowledged region
  exists at the end;
* a handle never reaches another incarnation of its name, and its operations raise
  ``RegionNotFound`` once its region is deleted (also when the delete was retried at a
  new leader after the old one died between removing the region and freeing its memory);
* only typed errors (:class:`~smb_protocol.errors.SMBError`); anything else is a
  violation;
* nothing hangs: a worker's step (an operation, and learning the outcome of one that
  raised) ends within :data:`STEP_BOUND`, an ``all_reduce`` within
  :data:`ALL_REDUCE_BOUND`;
* the daemons' memory and descriptors stay flat: RSS and open descriptors of every
  controller and memory server process are sampled every second; for each process
  that lived long enough, the mean of the last quarter of its samples after
  :data:`WARMUP` must not exceed that of the first quarter by more than
  :data:`RSS_MARGIN` (+ :data:`RSS_SLACK`), and likewise descriptors
  (:data:`FD_MARGIN`, :data:`FD_SLACK`). The margins are generous on purpose: a standby
  that becomes leader, and a server that takes repaired copies, grow by a step; a leak
  grows without end.

It prints a progress line every :data:`PROGRESS` seconds, a summary at the end, and
writes JSON (``--json``) and a PNG (``--plot``) of operations per second, RSS and
descriptors over time, with the faults marked.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from smb_client import Client, Collective  # noqa: E402
from smb_client.region import Region  # noqa: E402
from smb_protocol import errors  # noqa: E402
from smb_server.commands.local_cluster import wait_for_json  # noqa: E402
from smb_server.testing import ControllerGroup, EtcdServer  # noqa: E402

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20

SERVERS = 3                 # memory servers
CONTROLLERS = 2             # controllers on the etcd store
CAPACITY = "128M"           # per memory server
LEADER_LEASE = 2            # seconds: a standby leads this long after the leader died
SERVER_LEASE = 3.0          # seconds: a memory server without heartbeat is down after this
REGION_BYTES = 256 * KiB    # every data region
WORDS_BYTES = 4 * KiB       # the first bytes of a region: int64 words for arithmetic
REGIONS_PER_WORKER = 3
MAX_WRITE = 32 * KiB        # bytes of one write or read at most
SHARED_WORDS = 16           # counters every worker adds to
COLLECTIVE_PARTIES = 3
COLLECTIVE_BYTES = 64 * KiB     # int64 data of one all_reduce
COLLECTIVE_CHUNK = 16 * KiB     # so that its chunks lie on every server
COLLECTIVE_TIMEOUT = 15.0       # seconds a push or pull waits for the other parties
COLLECTIVE_BLOCK = 10           # rounds between two meetings of the parties
RESTART_DELAYS = (0.5, 5.0)     # seconds a killed memory server stays down, by turns
RECOVERY_TIMEOUT = 90.0         # seconds the cluster has to be healthy again after a fault
RESOLVE_TIMEOUT = 60.0          # seconds a worker tries to learn what a failed mutation did
FAULT_QUIET = COLLECTIVE_TIMEOUT + 5.0   # seconds after recovery still in the fault's window
JOIN_TIMEOUT = 120.0            # seconds a worker has to stop once asked
CLIENT_RECONNECT = 60.0         # seconds control calls keep retrying (covers a failover)
SAMPLE = 1.0                    # seconds between resource samples
PROGRESS = 10.0                 # seconds between progress lines
WARMUP = 15.0                   # seconds of a process's life left out of the flatness check
MIN_SAMPLES = 12                # samples after warm-up a process needs to be judged
RSS_MARGIN = 0.20               # last-quarter mean RSS may exceed the first quarter's by 20 %
RSS_SLACK = 24 * MiB            # ... plus this
FD_MARGIN = 0.25                # likewise open descriptors: 25 %
FD_SLACK = 24                   # ... plus this many
STEP_BOUND = 180.0               # seconds one worker step may take: failover (30) + resolving (60) + slack
ALL_REDUCE_BOUND = 2 * COLLECTIVE_TIMEOUT + 10.0   # seconds an all_reduce may take before it raised
MAX_LOGGED = 500                # typed errors kept with their time and message (JSON: error_log)
MAX_PRINTED = 20                # violations printed as they happen (all are in the summary)




def _now() -> float:
    return time.monotonic()


# -- bookkeeping ---------------------------------------------------------------------
@dataclass
class Fault:
    kind: str                   # "server" or "leader"
    target: str                 # the server id, or the controller's address
    at: float                   # seconds since the start
    recovered: float | None = None
    detail: str = ""


@dataclass
class Meta:
    """What the soak knows of one region it created (acknowledged)."""

    name: str
    uid: str
    replicas: int
    persistent: bool
    servers: frozenset[str]
    created: float              # monotonic, taken before the create call


class Tally:
    """Counts and findings shared by every thread (all under one lock)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()       # "Type (op)" -> count
        self.errors_outside: Counter[str] = Counter()   # typed errors outside every fault window
        self.error_log: list[str] = []              # the first MAX_LOGGED errors, with their time
        self.unknown: Counter[str] = Counter()      # mutations whose call raised: outcome learned
        self.per_second: list[int] = []
        self.violations: list[str] = []
        self.faults: list[Fault] = []
        self.kills: list[tuple[str, float]] = []    # (server id, monotonic time)
        self.regions: dict[str, Meta] = {}          # name -> the live incarnation
        self.expected_lost: set[str] = set()        # uids
        self.shared_acked = [0] * SHARED_WORDS
        self.shared_unknown = [0] * SHARED_WORDS
        self.stale_checks = 0
        self.longest: dict[str, float] = {}         # operation kind -> its longest duration, seconds
        self.collective_rounds = 0
        self.collective_builds = 0

    def t(self) -> float:
        return _now() - self.start

    def op(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.ops[kind] += n
            sec = int(self.t())
            while len(self.per_second) <= sec:
                self.per_second.append(0)
            self.per_second[sec] += n

    def error(self, kind: str, exc: BaseException) -> None:
        key = f"{type(exc).__name__} ({kind})"
        with self.lock:
            self.errors[key] += 1
            if not self._in_fault_window():
                self.errors_outside[key] += 1
            if len(self.error_log) < MAX_LOGGED:
                self.error_log.append(f"[{self.t():7.1f}s] {key}: {exc}")
        log.debug("%s: %s", key, exc)

    def _in_fault_window(self) -> bool:
        t = self.t()
        for f in self.faults:
            end = f.recovered if f.recovered is not None else float("inf")
            if f.at - 1.0 <= t <= end + FAULT_QUIET:
                return True
        return False

    def took(self, kind: str, seconds: float, bound: float) -> None:
        """Record the duration of one operation; longer than ``bound``: a violation (it
        hung past every timeout that should have ended it)."""
        with self.lock:
            if seconds > self.longest.get(kind, 0.0):
                self.longest[kind] = seconds
        if seconds > bound:
            self.violation(f"a {kind} took {seconds:.1f} s, more than its bound of {bound:.0f} s")

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(f"[{self.t():7.1f}s] {text}")
            n = len(self.violations)
        if n <= MAX_PRINTED:
            print(f"VIOLATION [{self.t():.1f}s] {text}", flush=True)

    def untyped(self, where: str, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        self.violation(f"untyped exception in {where}: {type(exc).__name__}: {exc}\n{tb}")

    def killed_since(self, servers: frozenset[str], since: float) -> bool:
        with self.lock:
            return any(sid in servers and at >= since for sid, at in self.kills)

    def expect_lost(self, meta: Meta) -> bool:
        """Whether the region may be gone: unreplicated, memory-only, and one of its
        servers was killed after it was made."""
        if meta.replicas > 1 or meta.persistent:
            return False
        return self.killed_since(meta.servers, meta.created - 1.0)


def _servers_of(region: Region) -> frozenset[str]:
    return frozenset({e.server_id for e in region.extents} | {c.server_id for c in region.copies})


# -- the cluster ---------------------------------------------------------------------
class SoakCluster(ControllerGroup):
    """The tests' controller group, with memory servers that serve tcp and shm, keep a
    ``data_dir``, and can be killed and started again on their state directory."""

    def __init__(self, workdir: Path, store: str) -> None:
        super().__init__(workdir, store, count=CONTROLLERS, leader_lease=LEADER_LEASE,
                         server_lease=SERVER_LEASE)
        self.server_ids: list[str] = []

    def start_memory_server(self, i: int, wait: bool = True) -> None:
        """Start memory server ``i`` (again, on the same state directory: same id)."""
        state = self.workdir / f"server-{i}"
        state.mkdir(exist_ok=True)
        ready = state / "ready"
        ready.unlink(missing_ok=True)
        proc = self._spawn(f"server-{i}", [
            "server", "--controller", ",".join(self.addresses), "--capacity", CAPACITY,
            "--state-dir", str(state), "--data-dir", str(state / "data"),
            "--secret-file", str(self.secret_file), "--ready-file", str(ready),
            "--transports", "tcp,shm", "--heartbeat", "0.3"])
        if i < len(self.servers):
            self.servers[i] = proc
        else:
            self.servers.append(proc)
        if wait:
            self.wait_memory_server(i)

    def wait_memory_server(self, i: int) -> None:
        state = self.workdir / f"server-{i}"
        doc = wait_for_json(state / "ready", 60.0, self.servers[i])
        sid = str(doc["server_id"])
        if i < len(self.server_ids):
            self.server_ids[i] = sid
        else:
            self.server_ids.append(sid)

    def kill_memory_server(self, i: int) -> None:
        proc = self.servers[i]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def processes(self) -> dict[str, int]:
        """role -> pid of every live daemon."""
        out = {}
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                out[f"controller-{i}"] = p.pid
        for i, p in enumerate(self.servers):
            if p.poll() is None:
                out[f"server-{i}"] = p.pid
        return out

    def new_client(self, transport: str = "tcp") -> Client:
        return Client(",".join(self.addresses), self.token, transport=transport,
                      reconnect_timeout=CLIENT_RECONNECT)


# -- data workers --------------------------------------------------------------------
@dataclass
class Tracked:
    """A region a worker owns, with its shadow copy."""

    handle: Region
    meta: Meta
    shadow: bytearray = field(default_factory=lambda: bytearray(REGION_BYTES))


class Unresolved(Exception):
    """A worker could not learn what a failed mutation did within RESOLVE_TIMEOUT."""


class DataWorker:
    """One client, a few regions of one kind, random operations checked against shadows;
    runs in a thread of its own (:meth:`start`)."""

    def __init__(self, wid: int, cluster: SoakCluster, tally: Tally, stop: threading.Event, *,
                 transport: str, replicas: int = 1, persistent: bool = False, seed: int = 0) -> None:
        self.name = f"soak-data-{wid}"
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self.wid, self.cluster, self.tally, self.stop = wid, cluster, tally, stop
        self.transport, self.replicas, self.persistent = transport, replicas, persistent
        self.rng = random.Random(seed * 1000 + wid)
        self.kind = f"{transport}/r{replicas}{'/persistent' if persistent else ''}"
        self.client = cluster.new_client(transport)
        self.slots: list[Tracked | None] = [None] * REGIONS_PER_WORKER
        self.generation = [0] * REGIONS_PER_WORKER
        self.shared: Region | None = None

    def _region_name(self, slot: int) -> str:
        return f"soak/w{self.wid}/s{slot}/g{self.generation[slot]}"

    # -- region life -------------------------------------------------------------------
    def _create(self, slot: int, name: str | None = None) -> None:
        name = name or self._region_name(slot)
        placement = self.rng.choice(["single", "striped"])
        created = _now()
        try:
            region = self.client.create_region(
                name, REGION_BYTES, placement=placement, stripe_unit=64 * KiB,
                num_servers=0 if placement == "single" else 2, replicas=self.replicas,
                persistent=self.persistent)
        except errors.RegionExists:
            # an earlier create that raised did take effect: start over on it
            self.tally.error("create", errors.RegionExists(name))
            self._delete(name)
            return
        except errors.SMBError as exc:
            self.tally.error("create", exc)
            self.stop.wait(0.2)     # a fault: give the cluster a moment
            return
        meta = Meta(name, region.uid, self.replicas, self.persistent, _servers_of(region), created)
        with self.tally.lock:
            self.tally.regions[name] = meta
        self.tally.op("create")
        self.slots[slot] = Tracked(region, meta)

    def _delete(self, name: str) -> bool:
        try:
            self.client.delete_region(name)
        except errors.RegionNotFound:
            pass
        except errors.SMBError as exc:
            self.tally.error("delete", exc)
            return False
        with self.tally.lock:
            self.tally.regions.pop(name, None)
        self.tally.op("delete")
        return True

    def _drop(self, slot: int, why: str) -> None:
        """Give up region ``slot`` (lost as expected): delete it; a new one is made later."""
        tr = self.slots[slot]
        if tr is None:
            return
        log.info("worker %d drops %s: %s", self.wid, tr.meta.name, why)
        with self.tally.lock:
            self.tally.expected_lost.add(tr.meta.uid)
        if self._delete(tr.meta.name):
            self.slots[slot] = None
            self.generation[slot] += 1

    def _recycle(self, slot: int) -> None:
        """Delete the region and create it again under the same name: the old handle must
        refuse every operation with RegionNotFound and never reach the new region."""
        tr = self.slots[slot]
        assert tr is not None
        if not self._delete(tr.meta.name):
            return
        self.slots[slot] = None
        self._create(slot, tr.meta.name)
        new = self.slots[slot]
        old = tr.handle
        for what, op in (("write", lambda: old.write(WORDS_BYTES, b"stale handle!")),
                         ("fetch_add", lambda: old.fetch_add(0, 1)),
                         ("read", lambda: old.read(0, 64))):
            try:
                op()
            except errors.RegionNotFound:
                continue
            except errors.SMBError as exc:
                self.tally.error(f"stale {what}", exc)
                continue
            self.tally.violation(f"{tr.meta.name}: a {what} through the handle of the deleted "
                                 f"incarnation {tr.meta.uid} succeeded")
        with self.tally.lock:
            self.tally.stale_checks += 1
        if new is not None:
            self._check_read(slot, 0, REGION_BYTES, "recycled")

    # -- operations ----------------------------------------------------------------------
    def _lost_or_gone(self, slot: int, exc: errors.SMBError, what: str) -> bool:
        """Handle an error that may mean the region is gone; True when the slot was dropped."""
        tr = self.slots[slot]
        assert tr is not None
        if self.tally.expect_lost(tr.meta):
            if isinstance(exc, (errors.RegionLost, errors.RegionNotFound, errors.Unavailable,
                                errors.Timeout)):
                self._drop(slot, f"{type(exc).__name__} after its server was killed")
                return True
            return False
        if isinstance(exc, (errors.RegionLost, errors.RegionNotFound)):
            self.tally.violation(f"{tr.meta.name} ({self.kind}, uid {tr.meta.uid}): {what} raised "
                                 f"{type(exc).__name__} although none of its copies may be gone: {exc}")
            self._drop(slot, "unexpectedly gone")
            return True
        return False

    def _retry(self, slot: int, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` until it succeeds (a worker learning what a failed mutation did);
        Unresolved after RESOLVE_TIMEOUT or when the region turns out to be gone."""
        deadline = _now() + RESOLVE_TIMEOUT
        while True:
            try:
                return fn()
            except errors.SMBError as exc:
                self.tally.error(f"{what} (resolving)", exc)
                if self._lost_or_gone(slot, exc, what):
                    raise Unresolved(f"{what}: region gone") from None
                if _now() > deadline:
                    tr = self.slots[slot]
                    assert tr is not None
                    self.tally.violation(f"{tr.meta.name} ({self.kind}): could not {what} for "
                                         f"{RESOLVE_TIMEOUT:.0f} s after a failed mutation: {exc}")
                    self._drop(slot, "unresolved")
                    raise Unresolved(what) from None
                time.sleep(0.2)

    def _check_read(self, slot: int, offset: int, length: int, why: str) -> None:
        tr = self.slots[slot]
        assert tr is not None
        try:
            got = bytes(tr.handle.read(offset, length))
        except errors.SMBError as exc:
            self.tally.error("read", exc)
            self._lost_or_gone(slot, exc, "read")
            return
        self.tally.op("read")
        want = bytes(tr.shadow[offset:offset + length])
        if got != want:
            if self.tally.expect_lost(tr.meta):
                self._drop(slot, "read other bytes after its server was killed")
                return
            first = next(i for i in range(length) if got[i] != want[i])
            self.tally.violation(
                f"{tr.meta.name} ({self.kind}, {why}): read at {offset}+{length} differs from what "
                f"was acknowledged at byte {offset + first}: got {got[first:first + 8].hex()}, "
                f"want {want[first:first + 8].hex()}")
            tr.shadow[offset:offset + length] = got   # report each difference once

    def _write(self, slot: int) -> None:
        tr = self.slots[slot]
        assert tr is not None
        n = self.rng.randint(1, MAX_WRITE)
        offset = self.rng.randint(WORDS_BYTES, REGION_BYTES - n)
        data = self.rng.randbytes(n)
        try:
            tr.handle.write(offset, data)
        except errors.SMBError as exc:
            self.tally.error("write", exc)
            if self._lost_or_gone(slot, exc, "write"):
                return
            # a write that raised may have landed, wholly or partly: write it again
            self._retry(slot, lambda: tr.handle.write(offset, data), "write again")
            with self.tally.lock:
                self.tally.unknown["write"] += 1
        self.tally.op("write")
        tr.shadow[offset:offset + n] = data

    def _words(self, tr: Tracked, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(tr.shadow, np.int64, count=count, offset=offset)

    def _arith(self, slot: int, what: str, offset: int, count: int,
               call: Callable[[], Any], after: np.ndarray, check: Callable[[Any], str | None]) -> None:
        """One arithmetic mutation of ``count`` words at ``offset``: ``after`` is what they
        hold once it took effect (once); ``check`` judges its answer."""
        tr = self.slots[slot]
        assert tr is not None
        before = self._words(tr, offset, count).copy()
        try:
            answer = call()
        except errors.SMBError as exc:
            self.tally.error(what, exc)
            if self._lost_or_gone(slot, exc, what):
                return
            got = self._retry(slot, lambda: tr.handle.read(offset, 8 * count, dtype="int64"), "read back")
            if np.array_equal(got, after):
                outcome = "applied"
            elif np.array_equal(got, before):
                outcome = "not applied"
            else:
                self.tally.violation(f"{tr.meta.name} ({self.kind}): a {what} that raised left "
                                     f"{got.tolist()[:4]}..., neither the value before "
                                     f"{before.tolist()[:4]}... nor after {after.tolist()[:4]}... "
                                     "(applied twice or partly)")
                self._words(tr, offset, count)[:] = got
                return
            with self.tally.lock:
                self.tally.unknown[f"{what} ({outcome})"] += 1
            self._words(tr, offset, count)[:] = got
            return
        self.tally.op(what)
        problem = check(answer)
        if problem:
            self.tally.violation(f"{tr.meta.name} ({self.kind}): {what} at {offset}: {problem}")
        self._words(tr, offset, count)[:] = after

    def _accumulate(self, slot: int) -> None:
        tr = self.slots[slot]
        assert tr is not None
        count = self.rng.randint(1, 64)
        offset = 8 * self.rng.randrange(0, WORDS_BYTES // 8 - count)
        add = np.array([self.rng.randint(-1000, 1000) for _ in range(count)], np.int64)
        after = self._words(tr, offset, count) + add
        self._arith(slot, "accumulate", offset, count, lambda: tr.handle.accumulate(offset, add),
                    after, lambda _: None)

    def _fetch_add(self, slot: int) -> None:
        tr = self.slots[slot]
        assert tr is not None
        offset = 8 * self.rng.randrange(WORDS_BYTES // 8)
        delta = self.rng.randint(1, 100)
        old = int(self._words(tr, offset, 1)[0])
        self._arith(slot, "fetch_add", offset, 1, lambda: tr.handle.fetch_add(offset, delta),
                    np.array([old + delta], np.int64),
                    lambda got: None if got == old else f"returned {got}, the word held {old}")

    def _compare_swap(self, slot: int) -> None:
        tr = self.slots[slot]
        assert tr is not None
        offset = 8 * self.rng.randrange(WORDS_BYTES // 8)
        old = int(self._words(tr, offset, 1)[0])
        hit = self.rng.random() < 0.7
        desired = self.rng.randint(-10**9, 10**9)
        after = np.array([desired if hit else old], np.int64)
        self._arith(slot, "compare_swap", offset, 1,
                    lambda: tr.handle.compare_swap(offset, old if hit else old + 1, desired), after,
                    lambda got: None if got == old else f"returned {got}, the word held {old}")

    def _shared_add(self) -> None:
        if self.shared is None:
            try:
                self.shared = self.client.open_region("soak/shared")
            except errors.SMBError as exc:
                self.tally.error("open shared", exc)
                return
        word = self.rng.randrange(SHARED_WORDS)
        use_fetch = self.rng.random() < 0.5
        try:
            if use_fetch:
                self.shared.fetch_add(8 * word, 1)
            else:
                self.shared.accumulate(8 * word, np.ones(1, np.int64))
        except errors.SMBError as exc:
            self.tally.error("shared add", exc)
            with self.tally.lock:
                self.tally.shared_unknown[word] += 1
            return
        with self.tally.lock:
            self.tally.shared_acked[word] += 1
        self.tally.op("fetch_add" if use_fetch else "accumulate")

    def step(self) -> None:
        """One operation (with what it takes to learn the outcome of one that raised);
        its time counts against :data:`STEP_BOUND`."""
        empty = [i for i, tr in enumerate(self.slots) if tr is None]
        slot = empty[0] if empty else self.rng.randrange(REGIONS_PER_WORKER)
        r = self.rng.random()
        kind, op = (("create", self._create) if empty else
                    ("write", self._write) if r < 0.30 else
                    ("read", self._read) if r < 0.55 else
                    ("accumulate", self._accumulate) if r < 0.68 else
                    ("fetch_add", self._fetch_add) if r < 0.78 else
                    ("compare_swap", self._compare_swap) if r < 0.84 else
                    ("shared add", lambda _slot: self._shared_add()) if r < 0.97 else
                    ("recycle", self._recycle))
        start = _now()
        try:
            op(slot)
        finally:
            self.tally.took(kind, _now() - start, STEP_BOUND)

    def _read(self, slot: int) -> None:
        n = self.rng.randint(1, MAX_WRITE)
        self._check_read(slot, self.rng.randint(0, REGION_BYTES - n), n, "read")

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
            except Unresolved:
                continue
            except BaseException as exc:  # noqa: BLE001 - every untyped exception is a finding
                self.tally.untyped(self.name, exc)
                self.stop.wait(1.0)     # a bug that repeats at once would flood the report

    def final_check(self) -> int:
        """Read every region whole, through the handle and through a fresh open by name
        (the same incarnation); returns the bytes checked."""
        checked = 0
        for slot, tr in enumerate(self.slots):
            if tr is None:
                continue
            self._check_read(slot, 0, REGION_BYTES, "final")
            if self.slots[slot] is None:
                continue
            try:
                fresh = self.client.open_region(tr.meta.name)
            except errors.SMBError as exc:
                self.tally.error("final open", exc)
                if not self.tally.expect_lost(tr.meta):
                    self.tally.violation(f"{tr.meta.name} ({self.kind}): cannot be opened at the end: "
                                         f"{type(exc).__name__}: {exc}")
                continue
            if fresh.uid != tr.meta.uid:
                self.tally.violation(f"{tr.meta.name}: opened as incarnation {fresh.uid}, "
                                     f"the worker holds {tr.meta.uid}")
                continue
            try:
                got = bytes(fresh.read(0, REGION_BYTES))
            except errors.SMBError as exc:
                self.tally.error("final read", exc)
                continue
            if got != bytes(tr.shadow) and not self.tally.expect_lost(tr.meta):
                first = next(i for i in range(REGION_BYTES) if got[i] != tr.shadow[i])
                self.tally.violation(f"{tr.meta.name} ({self.kind}): opened afresh at the end, "
                                     f"byte {first} differs from what was acknowledged")
            checked += REGION_BYTES
        return checked

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self.client.close()


# -- collectives ---------------------------------------------------------------------
class CollectiveGroup:
    """``COLLECTIVE_PARTIES`` threads, a client each, all-reducing int64 data in blocks of
    rounds; the parties meet (a threading barrier) between blocks, and build a new
    collective when one failed."""

    def __init__(self, cluster: SoakCluster, tally: Tally, stop: threading.Event) -> None:
        self.cluster, self.tally, self.stop = cluster, tally, stop
        self.parties = COLLECTIVE_PARTIES
        self.meet = threading.Barrier(self.parties)
        self.failed = False          # some party's last block failed: build anew
        self.name: str | None = None
        self.generation = 0
        self.threads = [threading.Thread(target=self._party, args=(rank,), name=f"soak-coll-{rank}",
                                         daemon=True) for rank in range(self.parties)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def abort(self) -> None:
        self.meet.abort()

    def join(self, timeout: float) -> bool:
        deadline = _now() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - _now()))
        return not any(t.is_alive() for t in self.threads)

    def _build(self, client: Client) -> None:
        """Rank 0: delete the last collective, create the next (self.name None on failure)."""
        if self.name is not None:
            try:
                client.delete_region(self.name)
            except errors.SMBError as exc:
                if not isinstance(exc, errors.RegionNotFound):
                    self.tally.error("collective delete", exc)
        self.generation += 1
        self.name = f"soak/coll/g{self.generation}"
        try:
            coll = Collective.create(client, self.name, COLLECTIVE_BYTES, self.parties,
                                     chunk_bytes=COLLECTIVE_CHUNK, timeout=COLLECTIVE_TIMEOUT)
            coll.close()
        except errors.SMBError as exc:
            self.tally.error("collective create", exc)
            self.name = None
            return
        with self.tally.lock:
            self.tally.collective_builds += 1

    def _party(self, rank: int) -> None:
        client = self.cluster.new_client("tcp")
        coll: Collective | None = None
        built = -1
        rounds = 0
        n = COLLECTIVE_BYTES // 8
        base = np.arange(n, dtype=np.int64)
        weight = self.parties * (self.parties + 1) // 2
        try:
            while True:
                try:
                    if self.meet.wait() == 0:     # one party decides for all
                        if self.stop.is_set():
                            self.meet.abort()
                        elif self.failed or self.name is None:
                            self._build(client)
                            self.failed = False
                    self.meet.wait()
                except threading.BrokenBarrierError:
                    return
                if self.name is None:
                    time.sleep(0.5)     # the create failed (a fault): the next meeting tries again
                    continue
                try:
                    if built != self.generation:
                        if coll is not None:
                            coll.close()
                        coll = None
                        coll = Collective.open(client, self.name, self.parties,
                                               timeout=COLLECTIVE_TIMEOUT, fresh=True)
                        built = self.generation
                        rounds = 0      # every party counts the rounds of a collective from 0
                    assert coll is not None
                    for _ in range(COLLECTIVE_BLOCK):
                        rounds += 1
                        data = (base + 7 * rounds) * (rank + 1)
                        start = _now()
                        try:
                            coll.all_reduce(data)
                        finally:
                            self.tally.took("all_reduce", _now() - start, ALL_REDUCE_BOUND)
                        want = (base + 7 * rounds) * weight
                        if not np.array_equal(data, want):
                            bad = int(np.argmax(data != want))
                            self.tally.violation(f"collective {self.name} round {rounds}: element {bad} "
                                                 f"is {int(data[bad])}, the exact sum is {int(want[bad])}")
                        self.tally.op("all_reduce")
                        if rank == 0:
                            with self.tally.lock:
                                self.tally.collective_rounds += 1
                except errors.SMBError as exc:
                    self.tally.error("all_reduce", exc)
                    self.failed = True
                    built = -1   # reopen: the parties' counts are out of step now
                except BaseException as exc:  # noqa: BLE001 - every untyped exception is a finding
                    self.tally.untyped(f"collective party {rank}", exc)
                    self.failed = True
                    built = -1
        finally:
            if coll is not None:
                coll.close()
            client.close()


# -- faults --------------------------------------------------------------------------
class FaultInjector(threading.Thread):
    """Kills a memory server or the leader every ``every`` seconds, by turns, each once the
    cluster is healthy again; restarts what it killed."""

    def __init__(self, cluster: SoakCluster, tally: Tally, stop: threading.Event, every: float,
                 end: float) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.cluster, self.tally, self.stop, self.every, self.end = cluster, tally, stop, every, end
        self.client = cluster.new_client("tcp")
        self.next_server = 0
        self.server_kills = 0

    def healthy(self) -> tuple[bool, str]:
        """Every memory server up, no region degraded, none lost unless expected."""
        servers = self.client.list_servers()
        down = [s.server_id for s in servers if s.state != "up"]
        if len(servers) < SERVERS or down:
            return False, f"servers not up: {down}"
        regions = self.client.list_regions("soak/")
        degraded = [r.name for r in regions if r.state == "degraded"]
        if degraded:
            return False, f"degraded: {degraded[:5]}"
        return True, ""

    def wait_healthy(self, timeout: float = RECOVERY_TIMEOUT) -> float | None:
        """Seconds until healthy, or None after ``timeout`` (the reason is logged)."""
        start = _now()
        why = ""
        while _now() - start < timeout:
            try:
                ok, why = self.healthy()
            except errors.SMBError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                return _now() - start
            time.sleep(0.2)
        log.warning("not healthy after %.0f s: %s", timeout, why)
        self.unhealthy = why
        return None

    unhealthy = ""

    def run(self) -> None:
        k = 0
        try:
            while True:
                at = self.tally.start + self.every * (k + 1)
                if at > self.end or self.stop.wait(max(0.0, at - _now())):
                    return
                if self.wait_healthy() is None:
                    self.tally.violation(f"the cluster was not healthy {RECOVERY_TIMEOUT:.0f} s after the "
                                         f"last fault ({self.unhealthy}); fault {k + 1} skipped")
                    k += 1
                    continue
                if k % 2 == 0:
                    self.kill_server()
                else:
                    self.kill_leader()
                k += 1
        except BaseException as exc:  # noqa: BLE001
            self.tally.untyped(self.name, exc)
        finally:
            self.client.close()

    def _record(self, fault: Fault) -> None:
        with self.tally.lock:
            self.tally.faults.append(fault)

    def kill_server(self) -> None:
        i = self.next_server
        self.next_server = (i + 1) % SERVERS
        sid = self.cluster.server_ids[i]
        delay = RESTART_DELAYS[self.server_kills % len(RESTART_DELAYS)]
        self.server_kills += 1
        with self.tally.lock:
            self.tally.kills.append((sid, _now()))
        fault = Fault("server", sid, self.tally.t(), detail=f"down {delay:g} s")
        self._record(fault)
        self.cluster.kill_memory_server(i)
        print(f"[{fault.at:6.1f}s] fault: memory server {sid} (server-{i}) killed (SIGKILL); "
              f"restart in {delay:g} s", flush=True)
        time.sleep(delay)
        self.cluster.start_memory_server(i)
        took = self.wait_healthy()
        fault.recovered = self.tally.t()
        state = f"after {took:.1f} s" if took is not None else f"NOT within {RECOVERY_TIMEOUT:.0f} s"
        print(f"[{fault.recovered:6.1f}s] server-{i} back; cluster healthy {state}", flush=True)
        if took is None:
            self.tally.violation(f"not healthy {RECOVERY_TIMEOUT:.0f} s after server {sid} came back "
                                 f"({self.unhealthy})")

    def kill_leader(self) -> None:
        leader = self.cluster.wait_leader(timeout=60)
        address = self.cluster.addresses[leader]
        fault = Fault("leader", address, self.tally.t())
        self._record(fault)
        self.cluster.kill(leader)
        others = tuple(i for i in range(CONTROLLERS) if i != leader)
        new = self.cluster.wait_leader(timeout=60, among=others)
        took = self.tally.t() - fault.at
        fault.detail = f"controller-{new} leads after {took:.2f} s"
        print(f"[{fault.at:6.1f}s] fault: leader controller-{leader} killed (SIGKILL); "
              f"controller-{new} leads after {took:.2f} s", flush=True)
        self.cluster.start_controller(leader)
        healthy = self.wait_healthy()
        fault.recovered = self.tally.t()
        if healthy is None:
            self.tally.violation(f"not healthy {RECOVERY_TIMEOUT:.0f} s after a leader kill ({self.unhealthy})")


# -- resources -----------------------------------------------------------------------
def _proc_sample(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open descriptors) of process ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * KiB for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return rss, fds


class Sampler(threading.Thread):
    """RSS and descriptors of every daemon, every SAMPLE seconds."""

    def __init__(self, cluster: SoakCluster, tally: Tally, stop: threading.Event) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.cluster, self.tally, self.stop = cluster, tally, stop
        self.samples: list[tuple[float, str, int, int, int]] = []   # (t, role, pid, rss, fds)
        self.lock = threading.Lock()

    def sample(self) -> None:
        t = self.tally.t()
        for role, pid in self.cluster.processes().items():
            got = _proc_sample(pid)
            if got is not None:
                with self.lock:
                    self.samples.append((t, role, pid, got[0], got[1]))

    def run(self) -> None:
        while not self.stop.wait(SAMPLE):
            self.sample()

    def latest(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        with self.lock:
            for _, role, _, rss, fds in self.samples[-20:]:
                out[role] = (rss, fds)
        return out


def flatness(samples: list[tuple[float, str, int, int, int]]) -> list[dict[str, Any]]:
    """One verdict per process (role and pid) that lived long enough: the means of the
    first and last quarter of its samples after WARMUP, and whether they stay within the
    margins."""
    series: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for t, role, pid, rss, fds in samples:
        series[(role, pid)].append((t, rss, fds))
    out = []
    for (role, pid), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        t0 = pts[0][0]
        kept = [p for p in pts if p[0] >= t0 + WARMUP]
        entry: dict[str, Any] = {"role": role, "pid": pid, "from": round(t0, 1), "to": round(pts[-1][0], 1),
                                 "samples": len(kept)}
        if len(kept) < MIN_SAMPLES:
            entry["judged"] = False
            out.append(entry)
            continue
        q = max(1, len(kept) // 4)
        rss0 = statistics.mean(p[1] for p in kept[:q])
        rss1 = statistics.mean(p[1] for p in kept[-q:])
        fd0 = statistics.mean(p[2] for p in kept[:q])
        fd1 = statistics.mean(p[2] for p in kept[-q:])
        entry.update(judged=True, rss_first=rss0, rss_last=rss1, fds_first=fd0, fds_last=fd1,
                     rss_ok=rss1 <= rss0 * (1 + RSS_MARGIN) + RSS_SLACK,
                     fds_ok=fd1 <= fd0 * (1 + FD_MARGIN) + FD_SLACK)
        out.append(entry)
    return out


# -- the run -------------------------------------------------------------------------
WORKER_KINDS = (("tcp", 1, False), ("tcp", 2, False), ("shm", 1, False), ("shm", 2, False),
                ("tcp", 1, True))


def run(minutes: float, workdir: Path, *, seed: int = 1, fault_every: float | None = None,
        plot: str | None = None, json_path: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the soak for ``minutes``; returns the result (``result["ok"]``: every invariant
    held). Owns the cluster it starts in ``workdir`` and stops it."""
    seconds = minutes * 60.0
    every = fault_every if fault_every is not None else min(90.0, max(20.0, seconds / 3))
    say: Callable[[str], None] = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
    workdir.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer()
    cluster = SoakCluster(workdir, etcd.url("soak"))
    stop = threading.Event()
    started = _now()
    try:
        cluster.start()
        cluster.wait_leader()
        for i in range(SERVERS):
            cluster.start_memory_server(i, wait=False)
        for i in range(SERVERS):
            cluster.wait_memory_server(i)
        with cluster.new_client() as c:
            deadline = _now() + 60
            while sum(s.state == "up" for s in c.list_servers()) < SERVERS:
                if _now() > deadline:
                    raise RuntimeError("the memory servers did not register within 60 s")
                time.sleep(0.1)
            c.create_region("soak/shared", 8 * SHARED_WORDS, replicas=2, placement="single")
        say(f"soak: etcd, {CONTROLLERS} controllers, {SERVERS} memory servers up in "
            f"{_now() - started:.1f} s ({workdir}); load for {seconds:.0f} s, a fault every {every:.0f} s")

        tally = Tally(_now())
        end = tally.start + seconds
        sampler = Sampler(cluster, tally, stop)
        sampler.sample()
        sampler.start()
        workers = [DataWorker(w, cluster, tally, stop, transport=tr, replicas=rep, persistent=per, seed=seed)
                   for w, (tr, rep, per) in enumerate(WORKER_KINDS)]
        with tally.lock:
            tally.regions["soak/shared"] = Meta("soak/shared", "", 2, False, frozenset(), tally.start)
        group = CollectiveGroup(cluster, tally, stop)
        faults = FaultInjector(cluster, tally, stop, every, end - 10.0)
        for w in workers:
            w.start()
        group.start()
        faults.start()

        last = 0
        while True:
            left = end - _now()
            if left <= 0:
                break
            time.sleep(min(PROGRESS, left))
            with tally.lock:
                total = sum(tally.ops.values())
                errs = sum(tally.errors.values())
                nviol = len(tally.violations)
                nfaults = len(tally.faults)
            now = sampler.latest()
            rss = " ".join(f"{role.replace('controller-', 'c').replace('server-', 's')}:{v[0] / MiB:.0f}"
                           for role, v in sorted(now.items()))
            fds = " ".join(f"{v[1]}" for _, v in sorted(now.items()))
            say(f"[{tally.t():6.1f}s] ops {total:,} ({(total - last) / PROGRESS:,.0f}/s)  errors {errs}  "
                f"faults {nfaults}  violations {nviol}  rss MiB {rss}  fds {fds}")
            last = total

        # stop the load, let the last fault finish, then check everything
        faults.join(RECOVERY_TIMEOUT + 120)
        load_seconds = tally.t()
        stop.set()
        group.abort()
        for w in workers:
            w.join(JOIN_TIMEOUT)
            if w.is_alive():
                tally.violation(f"{w.name} did not stop within {JOIN_TIMEOUT:.0f} s")
        if not group.join(JOIN_TIMEOUT):
            tally.violation(f"a collective party did not stop within {JOIN_TIMEOUT:.0f} s")
        healthy = faults_final_health(cluster, tally)
        checked = sum(w.final_check() for w in workers if not w.is_alive())
        final_regions(cluster, tally)
        final_shared(cluster, tally)
        sampler.sample()
        for w in workers:
            w.close()
        verdicts = flatness(sampler.samples)
        for v in verdicts:
            if v.get("judged") and not (v["rss_ok"] and v["fds_ok"]):
                tally.violation(
                    f"{v['role']} (pid {v['pid']}) grew: RSS {v['rss_first'] / MiB:.1f} -> "
                    f"{v['rss_last'] / MiB:.1f} MiB, descriptors {v['fds_first']:.0f} -> {v['fds_last']:.0f} "
                    f"(first vs last quarter after {WARMUP:.0f} s)")
        result = summary(tally, sampler.samples, verdicts, seconds=load_seconds, every=every,
                         checked=checked, healthy=healthy, workdir=workdir)
    finally:
        stop.set()
        cluster.stop()
        etcd.stop()
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result))
    if plot:
        write_plot(result, plot)
    if not quiet:
        print_summary(result)
    return result


def faults_final_health(cluster: SoakCluster, tally: Tally) -> float | None:
    injector = FaultInjector(cluster, tally, threading.Event(), 1.0, 0.0)
    try:
        took = injector.wait_healthy()
        if took is None:
            tally.violation(f"the cluster was not healthy {RECOVERY_TIMEOUT:.0f} s after the load stopped "
                            f"({injector.unhealthy})")
        return took
    finally:
        injector.client.close()


def final_regions(cluster: SoakCluster, tally: Tally) -> None:
    """Every acknowledged region exists, none is degraded, lost only where expected."""
    with cluster.new_client() as c:
        listed = {r.name: r for r in c.list_regions("soak/")}
    with tally.lock:
        known = dict(tally.regions)
    for name, meta in known.items():
        r = listed.get(name)
        if r is None:
            tally.violation(f"{name}: its create was acknowledged and it was never deleted, but it is gone")
        elif r.state == "lost" and not tally.expect_lost(meta):
            tally.violation(f"{name} (replicas {meta.replicas}, persistent {meta.persistent}) is lost")
        elif r.state == "degraded":
            tally.violation(f"{name} is still degraded at the end")


def final_shared(cluster: SoakCluster, tally: Tally) -> None:
    """Each shared counter equals its acknowledged increments (plus at most the unknown)."""
    with cluster.new_client() as c:
        try:
            got = c.open_region("soak/shared").read(0, 8 * SHARED_WORDS, dtype="int64").tolist()
        except errors.SMBError as exc:
            tally.violation(f"the shared counters cannot be read at the end: {type(exc).__name__}: {exc}")
            return
    for w, value in enumerate(got):
        acked, unknown = tally.shared_acked[w], tally.shared_unknown[w]
        if not acked <= value <= acked + unknown:
            tally.violation(f"shared counter {w} is {value}: {acked} increments acknowledged, "
                            f"{unknown} raised (applied {'twice' if value > acked + unknown else 'never'})")


def summary(tally: Tally, samples: list[tuple[float, str, int, int, int]], verdicts: list[dict[str, Any]], *,
            seconds: float, every: float, checked: int, healthy: float | None, workdir: Path) -> dict[str, Any]:
    roles: dict[str, dict[str, Any]] = {}
    for t, role, _pid, rss, fds in samples:
        r = roles.setdefault(role, {"rss_start": rss, "fds_start": fds, "t_start": t})
        r.update(rss_end=rss, fds_end=fds, t_end=t, rss_max=max(r.get("rss_max", 0), rss),
                 fds_max=max(r.get("fds_max", 0), fds))
    return {
        "ok": not tally.violations,
        "seconds": round(seconds, 1),
        "fault_every": every,
        "ops": dict(tally.ops.most_common()),
        "ops_total": sum(tally.ops.values()),
        "errors": dict(tally.errors.most_common()),
        "errors_outside_faults": dict(tally.errors_outside.most_common()),
        "error_log": list(tally.error_log),
        "unknown_outcomes": dict(tally.unknown.most_common()),
        "faults": [vars(f) for f in tally.faults],
        "violations": list(tally.violations),
        "stale_handle_checks": tally.stale_checks,
        "longest_seconds": {k: round(v, 2) for k, v in sorted(tally.longest.items())},
        "collective_rounds": tally.collective_rounds,
        "collective_builds": tally.collective_builds,
        "shared_counters": {"acked": sum(tally.shared_acked), "raised": sum(tally.shared_unknown)},
        "bytes_checked_at_end": checked,
        "healthy_after_load_s": healthy,
        "per_second": list(tally.per_second),
        "roles": roles,
        "flatness": verdicts,
        "samples": samples,
        "workdir": str(workdir),
        "margins": {"warmup_s": WARMUP, "rss": RSS_MARGIN, "rss_slack_bytes": RSS_SLACK, "fds": FD_MARGIN,
                    "fds_slack": FD_SLACK},
    }


def print_summary(r: dict[str, Any]) -> None:
    print(f"\nsoak: {r['seconds']:.0f} s of load, {r['ops_total']:,} operations acknowledged "
          f"({r['ops_total'] / max(1.0, r['seconds']):,.0f}/s)")
    print("  operations: " + ", ".join(f"{k} {v:,}" for k, v in r["ops"].items()))
    print("  errors (typed): " + (", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"))
    print("  of those outside fault windows: "
          + (", ".join(f"{k} {v}" for k, v in r["errors_outside_faults"].items()) or "none"))
    print("  mutations that raised, outcome then read: "
          + (", ".join(f"{k} {v}" for k, v in r["unknown_outcomes"].items()) or "none"))
    kinds = Counter(f["kind"] for f in r["faults"])
    print(f"  faults: {kinds.get('server', 0)} memory-server kills, {kinds.get('leader', 0)} leader kills")
    for f in r["faults"]:
        rec = f"healthy at {f['recovered']:.1f} s" if f["recovered"] is not None else "not recovered"
        print(f"    {f['at']:7.1f}s {f['kind']:6} {f['target']} {f['detail']}; {rec}")
    print(f"  collectives: {r['collective_rounds']:,} all_reduce rounds exact, {r['collective_builds']} built; "
          f"stale-handle checks {r['stale_handle_checks']}; shared counters: {r['shared_counters']['acked']:,} "
          f"increments acknowledged, {r['shared_counters']['raised']} raised; "
          f"{r['bytes_checked_at_end'] / MiB:.1f} MiB compared at the end")
    print("  longest operation (s, with resolving one that raised): "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["longest_seconds"].items()))
    print("  resources (RSS MiB, descriptors; start -> end, max):")
    for role, v in sorted(r["roles"].items()):
        print(f"    {role:13} RSS {v['rss_start'] / MiB:6.1f} -> {v['rss_end'] / MiB:6.1f} "
              f"(max {v['rss_max'] / MiB:.1f})   fds {v['fds_start']:4} -> {v['fds_end']:4} (max {v['fds_max']})")
    judged = [v for v in r["flatness"] if v.get("judged")]
    print(f"  flatness: {sum(v['rss_ok'] and v['fds_ok'] for v in judged)} of {len(judged)} processes judged "
          f"flat (last vs first quarter after {WARMUP:.0f} s: RSS +{RSS_MARGIN:.0%} + {RSS_SLACK // MiB} MiB, "
          f"fds +{FD_MARGIN:.0%} + {FD_SLACK}); {len(r['flatness']) - len(judged)} lived too short to judge")
    if r["violations"]:
        print(f"  INVARIANTS VIOLATED ({len(r['violations'])}):")
        for v in r["violations"][:50]:
            print("    " + v)
    else:
        print("  invariants: all held")


def write_plot(r: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8.0, 8.0), sharex=True)
    per = r["per_second"]
    window = max(5, len(per) // 150)
    smooth = [sum(per[max(0, i - window + 1):i + 1]) / min(window, i + 1) for i in range(len(per))]
    ax1.plot(range(len(per)), smooth, lw=0.9, color="tab:blue")
    ax1.set_ylabel(f"operations/s\n({window} s mean)")
    series: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for t, role, pid, rss, fds in r["samples"]:
        series[(role, pid)].append((t, rss, fds))
    colors: dict[str, str] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (role, _pid), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        label = None if role in colors else role    # one legend entry per role, not per process
        color = colors.setdefault(role, palette[len(colors) % len(palette)])
        ax2.plot([p[0] for p in pts], [p[1] / MiB for p in pts], lw=0.9, color=color, label=label)
        ax3.plot([p[0] for p in pts], [p[2] for p in pts], lw=0.9, color=color)
    ax2.set_ylabel("RSS (MiB)")
    ax3.set_ylabel("open descriptors")
    ax3.set_xlabel("seconds")
    for f in r["faults"]:
        for ax in (ax1, ax2, ax3):
            ax.axvline(f["at"], color="tab:red" if f["kind"] == "server" else "tab:purple", lw=0.7, ls="--")
    ax2.legend(fontsize=7, ncol=3, loc="upper left")
    ax1.set_title(f"soak: {r['seconds']:.0f} s; dashed: memory server (red) and leader (purple) killed")
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="minutes of load (default 5)")
    parser.add_argument("--fault-every", type=float, default=None,
                        help="seconds between faults (default: a third of the run, 20 to 90)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the workload's choices")
    parser.add_argument("--workdir", default=None, help="where the daemons keep state and logs "
                        "(default: a temporary directory, removed afterwards)")
    parser.add_argument("--plot", default=os.path.join(ROOT, "bench", "results", "soak.png"),
                        help="PNG of operations/s, RSS and descriptors over time")
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "soak.json"),
                        help="the result as JSON (with every resource sample)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.workdir:
        result = run(args.minutes, Path(args.workdir), seed=args.seed, fault_every=args.fault_every,
                     plot=args.plot, json_path=args.json)
    else:
        with tempfile.TemporaryDirectory(prefix="smb-soak-") as tmp:
            result = run(args.minutes, Path(tmp), seed=args.seed, fault_every=args.fault_every,
                         plot=args.plot, json_path=args.json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
