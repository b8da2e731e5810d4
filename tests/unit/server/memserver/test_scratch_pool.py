"""The TCP plane's shared scratch buffers: bounded in bytes, lent per request, counted."""
from __future__ import annotations

import threading
import time

import pytest

from smb_server.memserver.scratch import SCRATCH_KEEP, ScratchPool
from smb_server.memserver.stats import PlaneStats

CHUNK = 1 << 16


def test_pool_never_holds_more_than_its_limit_and_counts_buffers():
    stats = PlaneStats("tcp")
    pool = ScratchPool(limit=3 * CHUNK, chunk=CHUNK, stats=stats)
    bufs = [pool.acquire(time.monotonic() + 1) for _ in range(3)]
    assert all(len(b) == CHUNK for b in bufs)
    assert stats.limits()["scratch_bytes"] == 3 * CHUNK == pool.allocated
    assert stats.limits()["scratch_in_use"] == 3
    with pytest.raises(TimeoutError):
        pool.acquire(time.monotonic() + 0.05)
    assert stats.limits()["scratch_waits"] == 1
    for b in bufs:
        pool.release(b)
    assert pool.allocated == SCRATCH_KEEP * CHUNK            # the others are freed
    assert stats.limits()["scratch_in_use"] == 0
    pool.close()
    assert pool.allocated == 0 and stats.limits()["scratch_bytes"] == 0


def test_a_waiter_gets_the_buffer_released_by_another():
    pool = ScratchPool(limit=CHUNK, chunk=CHUNK)
    first = pool.acquire(time.monotonic() + 1)
    got: list[bytearray] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(time.monotonic() + 5)))
    waiter.start()
    time.sleep(0.05)
    assert not got
    pool.release(first)
    waiter.join(5)
    assert got and got[0] is first and pool.allocated == CHUNK


def test_limit_below_one_chunk_still_lends_one():
    pool = ScratchPool(limit=1, chunk=CHUNK)
    assert len(pool.acquire(time.monotonic() + 1)) == CHUNK
