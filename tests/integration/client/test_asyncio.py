"""The asyncio forms of a region's data-plane calls, of collectives and of barriers: the
same results and typed errors as the blocking calls, awaited without blocking the event
loop (a real local cluster, over tcp and shm)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from smb_client import Barrier, Collective
from smb_protocol import errors

KiB = 1 << 10


@pytest.fixture(params=["tcp", "shm"])
def region(cluster, name, request):
    with cluster.client(transport=request.param) as c:
        r = c.create_region(name, 64 * KiB, placement="single")
        yield r
        c.delete_region(name)


def test_awaited_calls_give_what_the_blocking_ones_give(region):
    async def main():
        data = np.arange(256, dtype=np.float32)
        await region.awrite(0, data)
        await region.aaccumulate(0, data)
        await region.aaxpy(0, data, 2.0)
        await region.ascale(0, 1024, 0.5, "float32")
        got = await region.aread(0, 1024, dtype="float32")
        out = np.empty(256, dtype=np.float32)
        same = await region.aread_into(0, out)
        await region.awrite_many([(4096, np.ones(4, np.int64)), (4160, np.full(4, 7, np.int64))])
        many = await region.aread_many([(4096, np.empty(4, np.int64)), (4160, np.empty(4, np.int64))])
        await region.aaccumulate_many([(4096, np.ones(4, np.int64))])
        return data, got, out, same, many
    data, got, out, same, many = asyncio.run(main())
    np.testing.assert_array_equal(np.asarray(got), data * 2)              # (d + d + 2d) / 2
    np.testing.assert_array_equal(out, data * 2)
    assert same is out
    assert [np.asarray(m).tolist() for m in many] == [[1] * 4, [7] * 4]
    assert np.asarray(region.read(4096, 32, dtype="int64")).tolist() == [2] * 4


def test_concurrent_tasks_add_up_and_a_waiter_lets_the_loop_run(region):
    word = 8192

    async def main():
        waiter = asyncio.create_task(region.await_word(word, value=50, timeout=30))
        olds = await asyncio.gather(*(region.afetch_add(word, 1) for _ in range(50)))
        reached = await waiter
        swapped = await region.acompare_swap(word, 50, 7)
        added = await region.afetch_add_many([(word, 1), (word + 8, 2)])
        return olds, reached, swapped, added
    olds, reached, swapped, added = asyncio.run(main())
    assert sorted(olds) == list(range(50)) and reached == 50       # every add seen once
    assert swapped == 50 and added == [7, 0]
    assert np.asarray(region.read(word, 16, dtype="int64")).tolist() == [8, 2]


def test_awaited_calls_raise_the_typed_errors(region):
    async def main():
        with pytest.raises(errors.OutOfRange):
            await region.aread(region.size - 8, 16)
        with pytest.raises(errors.Timeout):
            await region.await_word(0, equals=12345, timeout=0.2)
        with pytest.raises(errors.InvalidArgument, match="exactly one"):
            await region.await_word(0, value=1, equals=1)
    asyncio.run(main())


def test_a_cancelled_wait_ends_the_await_at_once(region):
    async def main():
        task = asyncio.create_task(region.await_word(16384, value=1, timeout=2))
        await asyncio.sleep(0)                    # let it start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await region.afetch_add(16384, 1)  # the loop and the region go on
    assert asyncio.run(main()) == 0


PARTIES = 3


def test_parties_awaiting_in_one_loop_all_reduce_and_broadcast(cluster, name):
    # all parties are tasks of one event loop: a blocking form would hold the loop in
    # the first party's round, which waits for the others for ever
    clients = [cluster.client() for _ in range(PARTIES)]
    try:
        colls = [Collective.create(clients[0], name, 64 * KiB, PARTIES, chunk_bytes=4 * KiB)]
        colls += [Collective.open(c, name, PARTIES, timeout=30) for c in clients[1:]]
        data = [np.arange(8 * 1024, dtype=np.int64) * (r + 1) for r in range(PARTIES)]
        sent = np.full(1000, 42.5, dtype=np.float32)
        got = [sent.copy() if r == 1 else np.zeros(1000, np.float32) for r in range(PARTIES)]

        async def main():
            sums = await asyncio.gather(*(coll.aall_reduce(d) for coll, d in zip(colls, data, strict=True)))
            await asyncio.gather(*(coll.abroadcast(got[r], 1, r) for r, coll in enumerate(colls)))
            return sums
        sums = asyncio.run(asyncio.wait_for(main(), 60))
        expected = np.arange(8 * 1024, dtype=np.int64) * (1 + 2 + 3)
        for r in range(PARTIES):
            assert sums[r] is data[r]
            np.testing.assert_array_equal(data[r], expected)
            np.testing.assert_array_equal(got[r], sent)
        colls[0].destroy()
        for coll in colls[1:]:
            coll.close()
    finally:
        for c in clients:
            c.close()


def test_parties_awaiting_a_barrier_in_one_loop(region):
    barriers = [Barrier(region, 32768, PARTIES, report_every=0.2) for _ in range(PARTIES)]

    async def main():
        first = await asyncio.gather(*(b.await_parties(timeout=30) for b in barriers))
        second = await asyncio.gather(*(b.await_parties(timeout=30) for b in barriers))
        with pytest.raises(errors.BarrierTimeout, match="1 of 3 parties arrived"):
            await barriers[0].await_parties(timeout=0.3)
        return first, second
    first, second = asyncio.run(asyncio.wait_for(main(), 60))
    assert first == [0] * PARTIES and second == [1] * PARTIES
