"""A collective gives exact sums or a typed error whatever the timing of ``create``, ``open``
and the first rounds: a party that opens late (the documented way, with or without
``fresh``), parties that start after any delay, and a party that comes back after the
others went on (refused with RoundMismatch, never mixed into a sum). Each party is a
client of its own in a thread of this process, against the shared local cluster.
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from smb_client.collective import Collective
from smb_protocol import errors
from smb_protocol.rounds import arrivals
from smb_server.testing import run_ranks, wait_until

KiB = 1 << 10
N = 3 * 1024          # int64 elements: several chunks of 4 KiB


def _inputs(rank: int, k: int) -> np.ndarray:
    """Party ``rank``'s input of round ``k`` (the issue's shape: i % 1000, scaled)."""
    return (np.arange(N, dtype=np.int64) % 1000) * (rank + 1) + 7 * k


def _want(parties: int, k: int) -> np.ndarray:
    return (np.arange(N, dtype=np.int64) % 1000) * (parties * (parties + 1) // 2) + 7 * k * parties


def _pushed(coll: Collective) -> int:
    """Arrivals in the first chunk's slot 0 (server-side, read through the region)."""
    raw = bytes(coll.region.read(coll.chunks[0].region_words, 8))
    return arrivals(int.from_bytes(raw, "little", signed=True))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("fresh", [None, False, True])
def test_a_party_that_opens_after_a_faster_one_pushed_gets_exact_sums(cluster, name, transport, fresh):
    late_opener_sums_exactly(cluster, name, transport, fresh)


def late_opener_sums_exactly(cluster, name: str, transport: str, fresh: bool | None = None) -> None:
    """Rank 0 creates the collective and starts its first all_reduce at once; rank 1
    opens it only once rank 0's pushes are in (the docs' way, any ``fresh``). Every
    round of both is exact. (The rdma tier runs it with rdma clients.)"""
    rounds = 4
    results: dict[int, list[np.ndarray]] = {0: [], 1: []}
    failures: list[BaseException] = []
    with cluster.client(transport=transport) as a, cluster.client(transport=transport) as b:
        first = Collective.create(a, name, N * 8, 2, chunk_bytes=4 * KiB, timeout=60)

        def rank0() -> None:
            try:
                for k in range(rounds):
                    results[0].append(first.all_reduce(_inputs(0, k)))
            except BaseException as exc:
                failures.append(exc)
        t = threading.Thread(target=rank0)
        t.start()
        try:
            wait_until(lambda: _pushed(first) >= 1, "rank 0's first push", pause=0.01)
            opts = {} if fresh is None else {"fresh": fresh}
            second = Collective.open(b, name, 2, timeout=60, **opts)
            for k in range(rounds):
                results[1].append(second.all_reduce(_inputs(1, k)))
            second.close()
        finally:
            t.join(60)
            first.destroy()
    assert not failures, failures
    for rank in (0, 1):
        for k, got in enumerate(results[rank]):
            np.testing.assert_array_equal(got, _want(2, k), err_msg=f"rank {rank}, round {k}")


def test_a_party_that_comes_back_mid_job_is_refused_and_mixes_nothing_in(cluster, name):
    """Ranks 0 and 1 run rounds; rank 1 then 'restarts': a new client opens the collective
    while rank 0 waits in the next round. The newcomer is refused (RoundMismatch) before it
    sends anything, rank 0's round times out (PartiesMissing) instead of summing it in."""
    with cluster.client() as a, cluster.client() as b, cluster.client() as again:
        first = Collective.create(a, name, N * 8, 2, chunk_bytes=4 * KiB, timeout=3)
        second = Collective.open(b, name, 2, timeout=3)
        t = threading.Thread(target=lambda: [second.all_reduce(_inputs(1, k)) for k in range(3)])
        t.start()
        for k in range(3):
            np.testing.assert_array_equal(first.all_reduce(_inputs(0, k)), _want(2, k))
        t.join(30)
        second.close()                                    # rank 1 is gone; rank 0 goes on
        failed: list[BaseException] = []
        waiting = threading.Thread(target=lambda: _catch(failed, first.all_reduce, _inputs(0, 3)))
        waiting.start()
        wait_until(lambda: _pushed(first) >= 1 or failed, "rank 0's push of round 3", pause=0.01)
        back = Collective.open(again, name, 2, timeout=3)
        with pytest.raises(errors.RoundMismatch, match="already has its 2 parties"):
            back.all_reduce(_inputs(1, 0))
        with pytest.raises(errors.RoundMismatch):
            back.broadcast(_inputs(1, 0), root=0, rank=1)
        back.close()
        waiting.join(30)
        assert len(failed) == 1 and isinstance(failed[0], errors.Timeout), failed
        first.destroy()


def _catch(out: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        out.append(exc)


DELAYS = [0.0, 0.4, 1.0, 2.0]


@pytest.mark.parametrize("delays", [d for d in itertools.permutations(DELAYS, 3)][::5])
def test_every_round_is_exact_whatever_the_start_delays(cluster, name, delays):
    """Three parties; the creator and the two openers each start after a delay of 0 to 2
    s (the delays are the scenario, not a wait for an event); all_reduce and broadcast
    alternate; every party checks every element of every round."""
    parties, rounds = 3, 5
    clients = [cluster.client() for _ in range(parties)]
    created = threading.Event()

    def party(rank: int) -> None:
        time.sleep(delays[rank])
        if rank == 0:
            coll = Collective.create(clients[0], name, N * 8, parties, chunk_bytes=4 * KiB, timeout=60)
            created.set()
        else:
            assert created.wait(30)
            coll = Collective.open(clients[rank], name, parties, timeout=60)
        with coll:
            for k in range(rounds):
                if k % 2:
                    got = coll.broadcast(_inputs(rank, k) if rank == k % parties else np.zeros(N, np.int64),
                                         root=k % parties, rank=rank)
                    np.testing.assert_array_equal(got, _inputs(k % parties, k))
                else:
                    np.testing.assert_array_equal(coll.all_reduce(_inputs(rank, k)), _want(parties, k))
    try:
        run_ranks(parties, party, timeout=90)
    finally:
        clients[0].delete_region(name)
        for c in clients:
            c.close()
