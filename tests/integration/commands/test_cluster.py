"""Whole-cluster behaviour: concurrency, restarts, failures, memory accounting, CLI."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import smb_client
from smb_protocol import errors

MiB = 1 << 20


def _accumulate_worker(address: str, token: str, name: str, rank: int, rounds: int, transport: str) -> None:
    with smb_client.connect(address, token, transport=transport) as c:
        r = c.open_region(name)
        n = r.size // 8
        for k in range(rounds):
            r.accumulate(0, np.full(n, rank + 1 + k, dtype=np.int64))
            r.accumulate(0, np.ones(n // 2, dtype=np.int64))
        r.fetch_add(0, 0)
        c.barrier(name + "/done", 4, timeout=60)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_four_processes_accumulate_exact_sum(cluster, client, name, transport):
    n = 3 * MiB // 8
    r = client.create_region(name, n * 8, stripe_unit=256 << 10)
    r.write(0, np.zeros(n, np.int64))
    rounds = 5
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_accumulate_worker,
                         args=(cluster.address, cluster.token, name, rank, rounds, transport))
             for rank in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    expect = np.zeros(n, np.int64)
    for rank in range(4):
        for k in range(rounds):
            expect += rank + 1 + k
            expect[: n // 2] += 1
    np.testing.assert_array_equal(r.read(dtype="int64"), expect)
    client.delete_region(name)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_delete_gives_memory_back(cluster, name):
    # over tcp the server itself touches the pages (over shm they would be charged to
    # this process's mapping instead)
    client = cluster.client(transport="tcp")
    r = client.create_region(name, 128 * MiB, placement="single")
    server = [i for i in range(cluster.num_servers) if cluster.server_id(i) == r.extents[0].server_id][0]
    pid = cluster.server_pid(server)
    before = _rss(pid)
    r.write(0, np.ones(128 * MiB, np.uint8))
    filled = _rss(pid)
    assert filled - before > 100 * MiB
    used = {s.server_id: s.used for s in client.list_servers()}[r.extents[0].server_id]
    assert used >= 128 * MiB
    r.close()
    client.delete_region(name)
    deadline = time.monotonic() + 10
    while _rss(pid) > filled - 100 * MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rss(pid) <= filled - 100 * MiB
    used_after = {s.server_id: s.used for s in client.list_servers()}[r.extents[0].server_id]
    assert used_after == used - 128 * MiB
    client.close()


def test_controller_restart_keeps_regions(fresh_cluster):
    c = fresh_cluster.client()
    r = c.create_region("job/params", 4 * MiB, stripe_unit=MiB)
    data = np.arange(MiB, dtype=np.float32)
    r.write(0, data)
    fresh_cluster.kill_controller()                   # kill -9
    # the data plane does not need the controller
    np.testing.assert_array_equal(r.read(dtype="float32"), data)
    with pytest.raises(errors.ControllerUnavailable):
        c.list_regions()
    fresh_cluster.start_controller()                  # same database, same address
    deadline = time.monotonic() + 20
    while True:
        servers = c.list_servers()
        if len(servers) == 2 and all(s.state == "up" for s in servers):
            break
        assert time.monotonic() < deadline, servers
        time.sleep(0.1)
    assert [x.name for x in c.list_regions()] == ["job/params"]
    r2 = c.open_region("job/params")
    np.testing.assert_array_equal(r2.read(dtype="float32"), data)
    r2.accumulate(0, data)
    np.testing.assert_array_equal(r.read(dtype="float32"), 2 * data)
    c.close()


def test_memory_server_kill_gives_clear_error(fresh_cluster):
    c = fresh_cluster.client(transport="tcp")
    r = c.create_region("job/grads", 4 * MiB, stripe_unit=MiB)
    r.write(0, np.ones(MiB, np.float32))
    victim = r.extents[1].server_id
    index = [i for i in range(2) if fresh_cluster.server_id(i) == victim][0]
    fresh_cluster.kill_server(index)
    start = time.monotonic()
    with pytest.raises(errors.ServerUnavailable):
        r.read(0, 4 * MiB)
    assert time.monotonic() - start < 10            # an error, not a hang
    # bytes on the surviving server still work
    survivor = 0 if r.extents[0].server_id != victim else 1
    off = survivor * MiB                                # stripe i lives on extent i % 2
    assert r.read(off, 16, dtype="float32").tolist() == [1.0] * 4
    deadline = time.monotonic() + 15
    while True:
        states = {s.server_id: s.state for s in c.list_servers()}
        if states[victim] == "down":
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.2)
    assert [x.state for x in c.list_regions()] == ["degraded"]
    # new regions go to the servers that are up
    r2 = c.create_region("job/other", MiB)
    assert {e.server_id for e in r2.extents} == {fresh_cluster.server_id(1 - index)}
    c.close()


def _smb(cluster, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    return subprocess.run([sys.executable, "-m", "smb_server.commands.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_cli_region_and_status(cluster):
    out = _smb(cluster, "region", "create", "cli/demo", "3M", "--placement", "layered",
               "--segments", "2M,1M")
    assert out.returncode == 0, out.stderr
    ls = _smb(cluster, "region", "ls", "cli/")
    assert "cli/demo" in ls.stdout and "layered" in ls.stdout
    st = _smb(cluster, "status")
    assert st.returncode == 0, st.stderr
    assert "cli/demo" in st.stdout and st.stdout.count(" up ") >= 2
    assert _smb(cluster, "region", "rm", "cli/demo").returncode == 0
    missing = _smb(cluster, "region", "rm", "cli/demo")
    assert missing.returncode == 1 and "RegionNotFound" in missing.stderr


def test_cli_region_rm_prefix_removes_a_jobs_regions(cluster):
    """`smb region rm --prefix job/` deletes that job's regions and no other; an empty
    prefix is refused instead of deleting everything."""
    with cluster.client(transport="tcp") as c:
        for name in ("rmjob/a", "rmjob/b/grads", "rmjobx/keep", "other/keep"):
            c.create_region(name, MiB, placement="single").close()
        out = _smb(cluster, "region", "rm", "--prefix", "rmjob/")
        assert out.returncode == 0, out.stderr
        assert "2 region(s)" in out.stdout
        names = {r.name for r in c.list_regions()}
        assert not {"rmjob/a", "rmjob/b/grads"} & names
        assert {"rmjobx/keep", "other/keep"} <= names
        with pytest.raises(errors.InvalidArgument):
            c.delete_regions("")
        assert _smb(cluster, "region", "rm").returncode != 0      # neither a name nor a prefix
        assert {"rmjobx/keep", "other/keep"} <= {r.name for r in c.list_regions()}
        assert c.delete_regions("rmjobx/") == ["rmjobx/keep"]
        c.delete_region("other/keep")


def test_orphan_extent_freed_after_grace(tmp_path):
    """A server that misses a release (stopped while its region is deleted) frees the
    extent itself once it is back and the controller reports the extent as an orphan."""
    from smb_server.commands.local_cluster import LocalCluster
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "c"),
                      orphan_grace_seconds=1.0, log_level="INFO") as cl, \
            cl.client(transport="tcp", reconnect_timeout=1.0) as c:
        victim = c.create_region("job/victim", 64 * MiB, placement="single")
        sid = victim.extents[0].server_id
        idx = [i for i in range(2) if cl.server_id(i) == sid][0]
        other = c.create_region("job/other", 4 * MiB, placement="single")
        data = np.arange(MiB, dtype=np.float32)
        other.write(0, data)
        pid = cl.server_pid(idx)
        victim.write(0, np.ones(64 * MiB, np.uint8))
        filled = _rss(pid)
        victim.close()
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            c.delete_region("job/victim")              # the release cannot reach the server
            assert time.monotonic() - t0 < 15
            assert "job/victim" not in [r.name for r in c.list_regions()]
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _rss(pid) > filled - 48 * MiB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _rss(pid) <= filled - 48 * MiB, "the orphan extent was not freed"
        assert "orphan" in cl.log_tail(f"server-{idx}", 200) or "orphan" in cl.log_tail("controller", 200)
        np.testing.assert_array_equal(other.read(dtype="float32")[:MiB], data)
        # the server is back in service: it takes new extents again
        deadline = time.monotonic() + 20
        while {s.server_id: s.state for s in c.list_servers()}[sid] != "up":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        again = c.create_region("job/again", 64 * MiB, placement="single", num_servers=1)
        again.write(0, np.ones(MiB, np.uint8))


def test_up_on_a_busy_port_says_so_in_one_line(tmp_path):
    """`smb up` on a port in use: one line naming the port and what to do, no traceback,
    and no pointer to a log that is already gone."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "smb_server.commands.cli", "up", "--port", str(port), "--servers", "1",
             "--capacity", "64M"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port {port}" in lines[0] and "--port" in lines[0] and "in use" in lines[0]
    assert ".log" not in lines[0]


def test_cluster_start_failure_is_typed_and_closes_everything(tmp_path):
    import socket

    from smb_server.commands.local_cluster import ClusterError, LocalCluster
    from smb_server.runtime.daemon import Status
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cluster = LocalCluster(servers=1, capacity="64M", controller_port=busy.getsockname()[1])
        with pytest.raises(ClusterError, match="already in use") as info:
            cluster.start()
    assert isinstance(info.value, errors.SMBError)
    assert cluster.status is Status.CLOSED
    assert not cluster.workdir.exists()
