"""Evacuating a memory server and rebalancing the pool while clients use every region,
against real processes: a controller and memory servers of their own, tcp and shared
memory, unreplicated and replicated regions, collectives. Every check is exact: counters
advanced once per acknowledged fetch_add, integer sums of acknowledged accumulates,
the last acknowledged write of every writer, integer all_reduce sums round after round.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from smb_client.collective import Collective
from smb_protocol import errors
from smb_server.commands.local_cluster import LocalCluster
from smb_server.testing.copies import compare_copies
from tests.integration.daemons import wait_state

MiB = 1 << 20
SETTLE = 120.0   # seconds an evacuation may take on a loaded 2-core machine


@pytest.fixture
def pool(tmp_path):
    """A controller and four memory servers of their own (they get evacuated and killed)."""
    with LocalCluster(servers=4, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as c:
        yield c


class Load:
    """Threads that keep using region ``region`` (opened by a client of its own each):
    fetch_add on word 0, int64 accumulates of ones over the first ``span`` bytes' tail,
    and writers that each own a range and remember their last acknowledged pattern.
    Every error is kept; :meth:`check` verifies the region against what was acknowledged."""

    SPAN = 3 * MiB        # the accumulated range ends half a MiB past it, the writers' ranges start 1 MiB past it

    def __init__(self, cluster: LocalCluster, name: str, transport: str, atomics: bool = True) -> None:
        self.cluster, self.name, self.transport = cluster, name, transport
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.adds: list[int] = []                 # every old value fetch_add answered
        self.accumulates = 0
        self.written: dict[int, int] = {}        # writer -> last acknowledged pattern
        self.ops = 0
        self._lock = threading.Lock()
        fns = [self._accumulator, self._writer(0), self._writer(1), self._reader]
        self._threads = [threading.Thread(target=self._run, args=(fn,), daemon=True)
                         for fn in ([self._counter] if atomics else []) + fns]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(SETTLE)
        assert not any(t.is_alive() for t in self._threads), "a client hangs"

    def wait_ops(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` more operations were acknowledged (the load runs)."""
        start = self.ops
        deadline = time.monotonic() + timeout
        while self.ops < start + n:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"only {self.ops - start} operations in {timeout} s"
            time.sleep(0.01)

    def _run(self, fn) -> None:
        try:
            with self.cluster.client(transport=self.transport) as c:
                region = c.open_region(self.name)
                while not self.stop.is_set():
                    fn(region)
                    with self._lock:
                        self.ops += 1
        except BaseException as exc:   # reported by check
            self.errors.append(exc)

    def _counter(self, region) -> None:
        old = region.fetch_add(0, 1)
        with self._lock:
            self.adds.append(old)

    def _accumulator(self, region) -> None:
        region.accumulate(self.SPAN - MiB // 2, np.ones(MiB // 8, np.int64))
        with self._lock:
            self.accumulates += 1

    def _writer(self, k: int):
        state = {"pattern": 0}
        offset = self.SPAN + MiB + k * 2 * MiB

        def write(region) -> None:
            state["pattern"] += 1
            region.write(offset, np.full(MiB // 8 + 1000, state["pattern"], np.int64))   # crosses a slot
            self.written[k] = state["pattern"]
        return write

    def _reader(self, region) -> None:
        got = region.read(self.SPAN + MiB, 2 * MiB)
        assert len(got) == 2 * MiB

    def check(self, region) -> None:
        assert not self.errors, self.errors
        assert sorted(self.adds) == list(range(len(self.adds))), "a fetch_add applied twice or lost"
        assert int(region.read(0, 8, dtype=np.int64)[0]) == len(self.adds)
        acc = region.read(self.SPAN - MiB // 2, MiB, dtype=np.int64)
        np.testing.assert_array_equal(acc, np.full(MiB // 8, self.accumulates, np.int64))
        for k, pattern in self.written.items():
            got = region.read(self.SPAN + MiB + k * 2 * MiB, MiB + 8000, dtype=np.int64)
            np.testing.assert_array_equal(got, np.full(MiB // 8 + 1000, pattern, np.int64))
        # and every backup holds what its primary holds (reads above go to the primaries)
        copies = compare_copies(region.client, self.name)
        assert copies["identical"], [s for s in copies["slots"] if s["differing_bytes"]] or copies


def holder_of_slot0(c, name: str) -> str:
    return c.open_region(name).route.extents[0].server_id


def wait_empty(admin, server_id: str, load: Load | None = None, timeout: float = SETTLE) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = next(x for x in admin.list_servers() if x.server_id == server_id)
        if s.extents == 0:
            return
        if load is not None:
            assert not load.errors, load.errors
        assert time.monotonic() < deadline, f"server {server_id} still holds {s.extents} extent(s)"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_evacuating_a_server_moves_every_copy_while_clients_keep_using_them(pool, transport, replicas):
    with pool.client(transport=transport) as c, pool.admin_client() as admin:
        region = c.create_region("job/params", 12 * MiB, stripe_unit=MiB, num_servers=3, replicas=replicas)
        source = holder_of_slot0(c, "job/params")
        with Load(pool, "job/params", transport) as load:
            load.wait_ops(200)
            admin.drain_server(source, evacuate=True)
            wait_empty(admin, source, load)
            load.wait_ops(200)          # and the load goes on at the new places
        wait_state(c, "job/params", "ready", timeout=SETTLE)
        load.check(region)              # the handle from before the move, never reopened
        region.refresh()
        assert source not in {p.server_id for p in (*region.route.extents, *region.route.copies)}
        assert all(r.state == "ready" for r in c.list_regions())
        # a drained, empty server leaves the pool; one that holds extents or is up cannot
        other = next(s.server_id for s in admin.list_servers() if s.server_id != source and s.extents)
        with pytest.raises(errors.InvalidArgument, match="drain it first"):
            admin.remove_server(other)
        assert admin.remove_server(source).server_id == source
        assert source not in {s.server_id for s in admin.list_servers()}


def test_collectives_run_through_an_evacuation_with_exact_sums(pool):
    collectives_through_an_evacuation(pool, "tcp", SETTLE)


def collectives_through_an_evacuation(pool, transport: str, settle: float) -> None:
    """Three parties sum round after round (exact integer sums) over ``transport`` while
    the server holding the collective's first chunk is evacuated; rounds go on at the
    new place, and every party ends at the same agreed round."""
    parties, n = 3, 3 * MiB // 8
    clients = [pool.client(transport=transport) for _ in range(parties)]
    coll0 = Collective.create(clients[0], "job/grads", n * 8, parties, chunk_bytes=256 * 1024, num_servers=3,
                              timeout=120)
    colls = [coll0] + [Collective.open(c, "job/grads", parties, timeout=120) for c in clients[1:]]
    source = coll0.region.route.extents[0].server_id
    rounds = [0] * parties
    errs: list[BaseException] = []
    stop = threading.Event()
    # the round every party ends before (set once; every party runs the same rounds: a party
    # that stopped on a flag of its own could leave the others waiting in a round it never joined)
    last: list[int] = []

    def run(rank: int) -> None:
        try:
            k = 0
            while not stop.is_set() and (not last or k < last[0]):
                x = np.arange(n, dtype=np.int64) * (rank + 1) + k
                colls[rank].all_reduce(x)
                np.testing.assert_array_equal(x, np.arange(n, dtype=np.int64) * 6 + 3 * k)
                k += 1
                rounds[rank] = k
        except BaseException as exc:
            errs.append(exc)
            stop.set()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(parties)]
    try:
        for t in threads:
            t.start()
        with pool.admin_client() as admin:
            while min(rounds) < 3 and not errs:
                time.sleep(0.01)
            admin.drain_server(source, evacuate=True)
            wait_empty(admin, source, timeout=settle)
            done = min(rounds)
            while min(rounds) < done + 3 and not errs:   # rounds go on at the new place
                time.sleep(0.01)
        last.append(max(rounds) + 2)   # no party began a round past max(rounds) yet
        for t in threads:
            t.join(settle)
        assert not errs, errs
        assert not any(t.is_alive() for t in threads)
        assert rounds == [last[0]] * parties
    finally:
        stop.set()
        for coll in colls[1:]:
            coll.close()
        coll0.destroy()
        for c in clients:
            c.close()


def test_a_target_killed_mid_move_is_replaced_and_nothing_is_lost(tmp_path):
    """The only other server is frozen, so the move to it cannot finish, and killed once
    the controller recorded its copy; a server that joins then takes the copy."""
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as pool, \
            pool.client(transport="tcp") as c, pool.admin_client() as admin:
        region = c.create_region("job/big", 32 * MiB, placement="single")
        data = np.random.default_rng(7).integers(0, 1 << 60, 32 * MiB // 8, dtype=np.int64)
        region.write(0, data)
        source = region.route.extents[0].server_id
        target = next(i for i in range(2) if pool.server_id(i) != source)
        os.kill(pool.server_pid(target), signal.SIGSTOP)
        admin.drain_server(source, evacuate=True)
        deadline = time.monotonic() + SETTLE
        while not [p for p in c.open_region("job/big").route.copies if p.role == "syncing"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pool.kill_server(target)          # SIGKILL ends a stopped process too
        pool.add_server()
        wait_empty(admin, source)
        region.refresh()
        assert region.route.extents[0].server_id not in (source, pool.server_id(target))
        np.testing.assert_array_equal(region.read(0, 32 * MiB, dtype=np.int64), data)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_controller_killed_mid_evacuation_resumes_it_after_its_restart(pool, transport):
    with pool.client(transport=transport) as c:
        region = c.create_region("job/params", 12 * MiB, stripe_unit=MiB, num_servers=3)
        source = holder_of_slot0(c, "job/params")
        with Load(pool, "job/params", transport) as load:
            load.wait_ops(100)
            with pool.admin_client() as admin:
                admin.drain_server(source, evacuate=True)
            pool.kill_controller()
            load.wait_ops(50)            # the data plane does not need the controller
            pool.start_controller()
            with pool.admin_client() as admin:
                wait_empty(admin, source, load)
            load.wait_ops(100)
        wait_state(c, "job/params", "ready", timeout=SETTLE)
        load.check(region)


def test_rebalance_spreads_bytes_and_slots_onto_servers_that_joined(tmp_path):
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as pool, \
            pool.client(transport="tcp") as c, pool.admin_client() as admin:
        region = c.create_region("job/params", 16 * MiB, stripe_unit=MiB)
        other = c.create_region("job/other", 8 * MiB, placement="single")
        other.write(0, np.arange(MiB, dtype=np.int64))
        with Load(pool, "job/params", "tcp") as load:
            load.wait_ops(100)
            pool.add_server()
            pool.add_server()
            pool.wait_servers(4)
            first = admin.rebalance()
            assert first.running and first.bytes_left > 0
            deadline = time.monotonic() + SETTLE
            while admin.rebalance().running:
                assert not load.errors, load.errors
                assert time.monotonic() < deadline
                time.sleep(0.1)
            load.wait_ops(100)
        load.check(region)
        np.testing.assert_array_equal(other.read(0, 8 * MiB, dtype=np.int64), np.arange(MiB, dtype=np.int64))
        used = [s.used for s in admin.list_servers()]
        assert len(used) == 4 and max(used) - min(used) <= 8 * MiB, used   # within the largest copy
        joined = {pool.server_id(2), pool.server_id(3)}
        assert any(s.extents for s in admin.list_servers() if s.server_id in joined)
        assert admin.rebalance(stop=True).bytes_moved >= 8 * MiB
        assert not admin.rebalance().running    # balanced: nothing to start


def test_the_commands_evacuate_show_progress_remove_and_rebalance(pool):
    """`smb server drain --evacuate`, `smb status`, `smb server remove` and `smb rebalance`
    as an operator types them (no terminal: progress comes as lines)."""
    env = dict(os.environ, SMB_CONTROLLER=pool.address, SMB_TOKEN=pool.token, SMB_ADMIN_TOKEN=pool.admin_token)

    def smb(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "smb_server.commands.cli", *args], capture_output=True,
                              text=True, timeout=SETTLE, env=env)
    with pool.client(transport="tcp") as c, pool.admin_client() as admin:
        region = c.create_region("job/params", 12 * MiB, stripe_unit=MiB, num_servers=3)
        region.write(0, np.arange(12 * MiB // 8, dtype=np.int64))
        source = holder_of_slot0(c, "job/params")
        out = smb("server", "drain", "--evacuate", "--server-id", source)
        assert out.returncode == 0, out.stderr
        assert f"evacuating {source}:" in out.stdout and "left" in out.stdout and "/s" in out.stdout
        assert f"server {source} holds nothing now" in out.stdout
        status = smb("status")
        assert status.returncode == 0, status.stderr
        row = next(line for line in status.stdout.splitlines() if line.startswith(source))
        assert " draining " in row and " 0 " in row
        out = smb("server", "remove", "--server-id", source)
        assert out.returncode == 0 and "removed from the pool" in out.stdout, out.stderr
        refused = smb("server", "remove", "--server-id", holder_of_slot0(c, "job/params"))
        assert refused.returncode != 0 and "drain it first" in refused.stderr
        c.create_region("job/more", 8 * MiB, placement="single")   # one server holds 12 MiB now, one joins empty
        pool.add_server()
        out = smb("rebalance", "--rate", str(64 * MiB))
        assert out.returncode == 0 and "balanced:" in out.stdout, out.stderr
        np.testing.assert_array_equal(region.read(0, dtype=np.int64), np.arange(12 * MiB // 8, dtype=np.int64))
        joined = pool.server_id(4)
        assert any(s.extents for s in admin.list_servers() if s.server_id == joined), out.stdout


def test_a_source_killed_mid_move_follows_the_rules_of_a_dead_server(tmp_path):
    """The move cannot finish (its only target is frozen) when the source is killed: the
    region is degraded, operations raise typed errors and report nothing done; the
    source back without its memory makes the region lost, never ready with zeros."""
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as pool, \
            pool.client(transport="tcp") as c, pool.admin_client() as admin:
        region = c.create_region("job/big", 32 * MiB, placement="single")
        region.write(0, np.ones(32 * MiB // 8, np.int64))
        source = region.route.extents[0].server_id
        src, target = [next(i for i in range(2) if (pool.server_id(i) == source) == want) for want in (True, False)]
        os.kill(pool.server_pid(target), signal.SIGSTOP)
        try:
            admin.drain_server(source, evacuate=True)
            deadline = time.monotonic() + SETTLE
            while not [p for p in c.open_region("job/big").route.copies if p.role == "syncing"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pool.kill_server(src)
        finally:
            os.kill(pool.server_pid(target), signal.SIGCONT)
        wait_state(c, "job/big", "degraded", timeout=SETTLE)
        with pytest.raises((errors.ServerUnavailable, errors.RegionLost)):
            region.accumulate(0, np.ones(8, np.int64))
        pool.start_server(src)                      # back, without its memory
        wait_state(c, "job/big", "lost", timeout=SETTLE)
        with pytest.raises(errors.RegionLost):
            region.read(0, 8)


def test_an_evacuation_with_nowhere_to_go_says_what_it_needs_and_moves_nothing(tmp_path, monkeypatch, capsys):
    """Two servers, a region with two copies: the evacuated server's copy has no other
    server to go to; the command says so and gives up at its timeout (exit 1), the copy
    stays and the region stays ready."""
    from smb_server.commands import pool as pool_cmd
    monkeypatch.setattr(pool_cmd, "STALLED_SECONDS", 1.0)
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as pool, \
            pool.client(transport="tcp") as c, pool.admin_client() as admin:
        c.create_region("job/two", 4 * MiB, placement="single", replicas=2)
        source = pool.server_id(0)
        assert pool_cmd.evacuate(admin, source, quiet=True, timeout=3.0) == 1
        err = capsys.readouterr().err
        assert "nothing moved for 1 s" in err and "still holds extents" in err
        assert next(s for s in admin.list_servers() if s.server_id == source).extents == 1
        assert {r.name: r.state for r in c.list_regions()}["job/two"] == "ready"
        admin.drain_server(source, undrain=True)      # cancels the evacuation
        assert not next(s for s in admin.list_servers() if s.server_id == source).evacuating
