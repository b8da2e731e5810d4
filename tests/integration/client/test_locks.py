"""Leased locks and barriers served by the memory servers, over tcp and shm: mutual
exclusion, the lease freeing the lock of a holder killed with SIGKILL, renewal, typed
errors, and barriers that keep their parties in step."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from smb_client import Barrier, Lock
from smb_protocol import errors
from smb_server.testing import run_ranks

MiB = 1 << 20
LOCK = 0            # byte offset of the lock word
COUNT = 8           # a counter the lock protects (read, then written: not atomic by itself)
BARRIER = 64        # byte offset of a barrier word


def _coordinate(region, offset, call):
    """One raw coordination request on the word at ``offset``, through the region's route:
    ``call(session, ticket, extent_id, extent_offset)``."""
    route = region.route
    slot, eoff = route.word(offset)
    return route.coordinate(slot, lambda s, place: call(s, route.ticket, place.extent_id, eoff))


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    return request.param


@pytest.fixture
def client(cluster, transport):
    with cluster.client(transport=transport) as c:
        yield c


@pytest.fixture
def region(client, name):
    r = client.create_region(name, MiB, placement="single")
    yield r
    client.delete_region(name)


def _word(region, offset) -> int:
    return int(region.read(offset, 8, dtype="int64")[0])


def test_a_held_lock_keeps_others_out_until_released(region):
    first, second = Lock(region, LOCK), Lock(region, LOCK)
    first.acquire()
    assert first.held and _word(region, LOCK) == first.holder
    with pytest.raises(errors.Timeout):
        second.acquire(timeout=0.3)
    first.release()
    assert _word(region, LOCK) == 0
    with second:
        assert _word(region, LOCK) == second.holder
    assert not second.held


def test_a_released_lock_wakes_a_waiting_acquirer(region):
    first, second = Lock(region, LOCK), Lock(region, LOCK)
    first.acquire()
    got = threading.Event()
    t = threading.Thread(target=lambda: (second.acquire(timeout=60), got.set()), daemon=True)
    t.start()
    first.release()
    t.join(60)
    assert got.is_set() and second.held
    second.release()


def test_lock_serializes_read_modify_write_from_several_threads(client, name):
    """Four threads each add 1 to a plain counter 25 times by read + write: only the
    lock makes the sum exact."""
    r = client.create_region(name, MiB, placement="single")
    try:
        def work() -> None:
            lock = Lock(r, LOCK)
            for _ in range(25):
                with lock:
                    n = _word(r, COUNT)
                    r.write(COUNT, np.array([n + 1], np.int64))
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert _word(r, COUNT) == 100
    finally:
        client.delete_region(name)


HOLDER = textwrap.dedent("""
    import sys, time
    import smb_client
    address, token, name, transport = sys.argv[1:5]
    c = smb_client.connect(address, token, transport=transport)
    lock = smb_client.Lock(c.open_region(name), 0, lease=1.0)
    lock.acquire()
    print(lock.holder, flush=True)
    time.sleep(600)
""")


def test_a_holder_killed_with_sigkill_frees_the_lock_after_its_lease(cluster, region, transport):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, cluster.address, cluster.token, region.name,
                             transport], stdout=subprocess.PIPE, text=True)
    try:
        holder = int(proc.stdout.readline())
        assert _word(region, LOCK) == holder
        mine = Lock(region, LOCK)
        with pytest.raises(errors.Timeout):
            mine.acquire(timeout=0.3)           # alive and renewing: still held
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        mine.acquire(timeout=60)                # the lease runs out, the lock is ours
        assert _word(region, LOCK) == mine.holder
        mine.release()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_keepalive_renews_the_lease_of_a_long_holder(region):
    with Lock(region, LOCK, lease=1.0) as long:
        time.sleep(2.5)                          # two and a half leases
        with pytest.raises(errors.Timeout):
            Lock(region, LOCK).acquire(timeout=0.3)
        assert long.held


def test_a_holder_past_its_lease_learns_it_lost_the_lock(region):
    stalled = Lock(region, LOCK, lease=0.1, keepalive=False)
    stalled.acquire()
    other = Lock(region, LOCK)
    other.acquire(timeout=60)                    # after the 0.1 s lease
    with pytest.raises(errors.LockNotHeld):
        stalled.renew()
    with pytest.raises(errors.LockNotHeld):
        stalled.release()
    assert _word(region, LOCK) == other.holder   # the stale release freed nothing
    other.release()


def test_unlock_by_a_stranger_is_refused(region):
    lock = Lock(region, LOCK)
    with lock:
        with pytest.raises(errors.LockNotHeld):
            _coordinate(region, LOCK, lambda s, ticket, extent, offset: s.unlock(ticket, extent, offset, 12345))
        assert _word(region, LOCK) == lock.holder
    with pytest.raises(errors.LockNotHeld):
        lock.release()                           # not held any more


@pytest.mark.parametrize("kwargs,error", [
    ({"offset": 4}, errors.Misaligned),
    ({"offset": MiB}, errors.OutOfRange),
    ({"offset": 0, "lease": 0}, errors.InvalidArgument),
    ({"offset": 0, "lease": float("nan")}, errors.InvalidArgument),
])
def test_bad_locks_are_refused(region, kwargs, error):
    with pytest.raises(error):
        Lock(region, **kwargs).acquire(timeout=1)


def test_wire_lock_with_holder_zero_or_a_bad_lease_is_refused(region):
    for holder, lease in ((0, 1.0), (7, 0.0)):
        with pytest.raises(errors.InvalidArgument):
            _coordinate(region, LOCK, lambda s, ticket, extent, offset, holder=holder, lease=lease: s.lock(
                ticket, extent, offset, holder, lease, 1.0))
    assert _word(region, LOCK) == 0


def test_a_read_only_handle_cannot_lock(cluster, region):
    with cluster.client() as other:
        with pytest.raises(errors.ReadOnly):
            Lock(other.open_region(region.name, "ro"), LOCK)


def test_barrier_keeps_parties_in_step(region):
    """Each of 4 threads writes its round number into its slot, meets the others, then
    reads every slot: all must show the same round (a party running ahead would have
    overwritten its slot with the next round)."""
    parties, rounds = 4, 15
    generations: list[list[int]] = [[] for _ in range(parties)]

    def party(i: int) -> None:
        b = Barrier(region, BARRIER, parties)
        for k in range(rounds):
            region.write(4096 + 8 * i, np.array([k], np.int64))
            generations[i].append(b.wait(timeout=60))
            seen = region.read(4096, 8 * parties, dtype="int64").tolist()
            assert seen == [k] * parties, (k, seen)
            generations[i].append(b.wait(timeout=60))   # nobody writes round k+1 before all read
    run_ranks(parties, party, timeout=300)
    assert all(g == list(range(2 * rounds)) for g in generations)
    assert _word(region, BARRIER) == 2 * rounds * parties


def test_barrier_times_out_with_barrier_timeout_when_a_party_is_missing(region):
    with pytest.raises(errors.BarrierTimeout):
        Barrier(region, BARRIER, 2).wait(timeout=0.3)
    assert _word(region, BARRIER) == 1            # it did arrive


def test_barrier_refuses_bad_parties(region):
    for parties in (0, -1, 1.5):
        with pytest.raises(errors.InvalidArgument):
            Barrier(region, BARRIER, parties)
