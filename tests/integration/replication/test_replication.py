"""Replicated regions against real processes: every copy identical after acknowledged
operations (concurrent writers included), a primary killed with SIGKILL mid-operation
(the operation finishes at the promoted backup and applies exactly once), repair onto a
spare server back to ``ready``, and a second kill after repair loses nothing."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from smb_protocol import errors
from smb_server.commands.local_cluster import LocalCluster
from tests.integration.daemons import wait_state

MiB = 1 << 20


@pytest.fixture
def three(tmp_path):
    """A controller and three memory servers of their own (they get killed)."""
    with LocalCluster(servers=3, capacity="256M", workdir=str(tmp_path / "cluster"),
                      log_level="INFO") as c:
        yield c


def _index(cluster: LocalCluster, server_id: str) -> int:
    return [i for i in range(cluster.num_servers) if cluster.server_id(i) == server_id][0]


def _copies(region) -> dict[int, list]:
    """Every in-sync copy of every layout slot (primary first)."""
    slots: dict[int, list] = {i: [p] for i, p in enumerate(region.extents)}
    for c in region.copies:
        if c.role == "backup":
            slots[c.index].append(c)
    return slots


def _read_copy(region, place) -> bytes:
    """The whole extent of one copy, read from its own server over tcp."""
    session = region.route.coordination(place)
    out = bytearray(place.length)
    session.read_into(region.route.ticket, place.extent_id, 0, [memoryview(out)])
    return bytes(out)


def assert_copies_identical(region) -> None:
    """Every in-sync copy of every slot holds the same bytes, once the region is ``ready``
    (on a starved machine, the emulated VM's, a backup may be dropped for a missed
    dead-peer time and filled again meanwhile: a copy being filled is not in step yet)."""
    wait_state(region.client, region.name, "ready", timeout=120)
    region.refresh()
    for slot, places in _copies(region).items():
        assert len(places) == region.replicas, f"slot {slot}: {places}"
        first = _read_copy(region, places[0])
        for other in places[1:]:
            assert _read_copy(region, other) == first, f"slot {slot}: copies differ"


def test_copies_live_on_distinct_servers(three):
    with three.client(transport="tcp") as c:
        r = c.create_region("job/rep", 6 * MiB, stripe_unit=MiB, replicas=2)
        assert r.replicas == 2 and r.state == "ready"
        for places in _copies(r).values():
            assert len({p.server_id for p in places}) == 2, places
            assert places[0].role == "primary"
        with pytest.raises(errors.InvalidArgument):
            c.create_region("job/too-many", MiB, replicas=9)


def check_concurrent_writers(client, name: str, size: int = 8 * MiB, chunk: int = 300_000) -> None:
    """Four threads write and accumulate overlapping float32 ranges of a replicated
    region; afterwards every copy is byte-identical and reads agree with the primaries."""
    r = client.create_region(name, size, stripe_unit=MiB, replicas=2)
    n = r.size // 4
    errs: list[BaseException] = []

    def writer(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            for _ in range(12):
                start = int(rng.integers(0, n - chunk))
                data = rng.standard_normal(chunk).astype(np.float32)
                if k % 2:
                    r.accumulate(start * 4, data)
                else:
                    r.write(start * 4, data)
        except BaseException as exc:   # reported below
            errs.append(exc)
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs, errs
    assert_copies_identical(r)
    # reads (over shm or rdma where the client uses them) see what the primaries hold
    assert r.read(0, r.size) == b"".join(
        _read_copy(r, r.extents[s.extent])[s.extent_offset:s.extent_offset + s.length]
        for s in r.layout.map(0, r.size))
    client.delete_region(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_concurrent_writers_leave_every_copy_identical(three, transport):
    with three.client(transport=transport) as c:
        check_concurrent_writers(c, "job/conc")


def check_primary_killed(cluster: LocalCluster, client, name: str, size: int = 24 * MiB) -> None:
    """kill -9 of a primary's server while accumulates run: each applies exactly once
    (at the promoted backup), the region is repaired onto the spare server with every
    copy identical, and a second kill after the repair loses nothing."""
    r = client.create_region(name, size, stripe_unit=MiB, replicas=2)
    n = r.size // 8
    r.write(0, np.arange(n, dtype=np.int64))
    victim = r.extents[0].server_id
    ones = np.ones(n, dtype=np.int64)
    done: list[BaseException | None] = []

    started, stop = threading.Event(), threading.Event()
    rounds = 0

    def accumulate() -> None:
        nonlocal rounds
        try:
            started.set()
            while not stop.is_set():      # back to back: one is in flight when the kill lands
                r.accumulate(0, ones)
                rounds += 1
            done.append(None)
        except BaseException as exc:   # reported below
            done.append(exc)
    t = threading.Thread(target=accumulate)
    t.start()
    started.wait()
    time.sleep(0.2)
    killed_at = rounds
    cluster.kill_server(_index(cluster, victim))          # kill -9 while accumulates run
    deadline = time.monotonic() + 60
    while rounds < killed_at + 3 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)                                  # more rounds at the new primary
    stop.set()
    t.join(120)
    assert done == [None], done
    assert rounds >= killed_at + 3, (killed_at, rounds)
    got = r.read(0, r.size, dtype=np.int64)
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.int64) + rounds)   # each applied once
    assert victim not in {p.server_id for p in r.extents}                # a backup took over

    wait_state(client, name, "ready", timeout=120)                       # repaired on the spare
    assert_copies_identical(r)
    assert victim not in {p.server_id for places in _copies(r).values() for p in places}

    # a second server dies after the repair: still nothing lost
    second = r.extents[0].server_id
    cluster.kill_server(_index(cluster, second))
    r.accumulate(0, ones)
    np.testing.assert_array_equal(r.read(0, r.size, dtype=np.int64),
                                  np.arange(n, dtype=np.int64) + rounds + 1)
    wait_state(client, name, "degraded", timeout=60)


def test_primary_killed_mid_operation_applies_once_then_repairs(three):
    with three.client(transport="tcp") as c:
        check_primary_killed(three, c, "job/fail")


def test_backup_killed_writes_go_on(three):
    with three.client(transport="tcp") as c:
        r = c.create_region("job/backup", 4 * MiB, placement="single", replicas=2)
        backup = [p for p in r.copies if p.role == "backup"][0].server_id
        three.kill_server(_index(three, backup))
        data = np.full(r.size // 4, 7, dtype=np.int32)
        r.accumulate(0, data)                 # waits until the controller drops the dead backup
        np.testing.assert_array_equal(r.read(0, r.size, dtype=np.int32), data)
        wait_state(c, "job/backup", "ready", timeout=60)
        assert_copies_identical(r)
