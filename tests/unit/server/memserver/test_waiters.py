"""The memory server's waiter table and lock leases, on real extents of an arena."""
from __future__ import annotations

import struct
import threading

import pytest

from smb_protocol.errors import ExtentNotFound, InvalidArgument, LockNotHeld, ServerUnavailable, Timeout
from smb_protocol.wire import WaitCond
from smb_server.memserver import waiters
from smb_server.memserver.arena import Arena
from smb_server.memserver.node import Node
from smb_server.memserver.tcp_plane import TcpPlane

MiB = 1 << 20


@pytest.fixture
def arena():
    a = Arena(16 * MiB)
    yield a
    a.close()


@pytest.fixture
def extent(arena):
    return arena.reserve(1, "uid", MiB)


def _set(extent, offset: int, value: int) -> None:
    struct.pack_into("<q", extent.data, offset, value)


def test_one_table_per_node(arena):
    """Every plane of a memory server wakes and waits through its node's one table."""
    node = Node(arena, bytes(32))
    try:
        with TcpPlane(node) as tcp:
            assert tcp.engine.node.waiters is node.waiters
        other = Node(Arena(MiB), bytes(32))
        try:
            assert other.waiters is not node.waiters
        finally:
            other.close()
            other.arena.close()
    finally:
        node.close()


@pytest.mark.parametrize("cond,value,word,met", [
    (WaitCond.AT_LEAST, 3, 3, True), (WaitCond.AT_LEAST, 3, 2, False),
    (WaitCond.EQUAL, 3, 3, True), (WaitCond.EQUAL, 3, 4, False),
    (WaitCond.CHANGED, 3, 4, True), (WaitCond.CHANGED, 3, 3, False),
])
def test_conditions(cond, value, word, met):
    assert waiters.holds(cond, word, value) is met


def test_touched_wakes_the_waits_on_the_bytes_it_covers(extent, monkeypatch):
    monkeypatch.setattr(waiters, "RECHECK", 60.0)   # only a wake-up can end the wait in time
    table = waiters.Waiters()
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(table.wait(extent, 64, WaitCond.EQUAL, 1, 30)))
    t.start()
    while table.waiting() == 0:
        pass
    _set(extent, 64, 1)
    table.touched(extent.extent_id + 1, 64, 8)      # another extent
    table.touched(extent.extent_id, 71, 1)          # the word's last byte
    t.join(30)
    assert got == [1] and table.waiting() == 0


def test_wait_times_out_with_the_word_in_the_message(extent):
    _set(extent, 8, 5)
    with pytest.raises(Timeout, match="is 5, not >= 6"):
        waiters.Waiters().wait(extent, 8, WaitCond.AT_LEAST, 6, 0.05)


def test_wait_ends_when_cancelled_or_released(arena, extent):
    table = waiters.Waiters()
    with pytest.raises(ServerUnavailable):
        table.wait(extent, 0, WaitCond.EQUAL, 1, 30, cancelled=lambda: True)
    arena.release(extent.extent_id)
    with pytest.raises(ExtentNotFound):
        table.wait(extent, 0, WaitCond.EQUAL, 1, 30)
    assert table.waiting() == 0


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), waiters.WAIT_MAX + 1])
def test_bad_timeouts_are_refused(extent, timeout):
    with pytest.raises(InvalidArgument):
        waiters.Waiters().wait(extent, 0, WaitCond.EQUAL, 0, timeout)


def test_lock_renew_unlock_and_lease_expiry(extent):
    table = waiters.Waiters()
    assert table.lock(extent, 0, 7, 0.05, 0) == 0
    assert table.lock(extent, 0, 7, 0.05, 0) == 7              # a renewal
    assert table.lock(extent, 0, 9, 10.0, 5) == 7              # after 7's lease ran out
    with pytest.raises(Timeout, match="held by 0x9"):
        table.lock(extent, 0, 7, 1.0, 0.05)
    with pytest.raises(LockNotHeld):
        table.unlock(extent, 0, 7)
    assert table.unlock(extent, 0, 9) == 9
    assert struct.unpack_from("<q", extent.data, 0)[0] == 0


def test_a_held_word_without_a_lease_gets_one_from_first_sight(extent):
    """A server restarted with a file-backed extent finds lock words set and no leases:
    the holder keeps the lock for one lease from then, and then loses it."""
    _set(extent, 16, 42)
    table = waiters.Waiters()
    with pytest.raises(Timeout):
        table.lock(extent, 16, 7, 0.2, 0.0)          # first sight: 42's lease starts now
    assert table.lock(extent, 16, 7, 0.2, 10) == 42


@pytest.mark.parametrize("holder,lease", [(0, 1.0), (7, 0.0), (7, float("nan")), (7, 1e9)])
def test_bad_locks_are_refused(extent, holder, lease):
    with pytest.raises(InvalidArgument):
        waiters.Waiters().lock(extent, 0, holder, lease, 0)
