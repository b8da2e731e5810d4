"""The wait, lock and barrier tests of tests/integration/client/test_notify.py and test_locks.py,
again with the regions' data over rdma (coordination requests go over the servers' tcp
planes; rdma fetch_add is a one-sided atomic that the server's re-read notices, and rdma
accumulate is served by the server, which wakes the waits at once), and the collectives
among rdma clients (on the same cluster: starting one takes minutes in the VM)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from smb_client.collective import Collective
from tests.integration.client.test_collective_timing import late_opener_sums_exactly
from tests.integration.client.test_locks import (  # noqa: F401  (collected here with transport=rdma)
    test_a_held_lock_keeps_others_out_until_released,
    test_a_holder_killed_with_sigkill_frees_the_lock_after_its_lease,
    test_a_holder_past_its_lease_learns_it_lost_the_lock,
    test_a_released_lock_wakes_a_waiting_acquirer,
    test_bad_locks_are_refused,
    test_barrier_keeps_parties_in_step,
    test_barrier_times_out_with_barrier_timeout_when_a_party_is_missing,
    test_keepalive_renews_the_lease_of_a_long_holder,
    test_lock_serializes_read_modify_write_from_several_threads,
    test_unlock_by_a_stranger_is_refused,
)
from tests.integration.client.test_notify import (  # noqa: F401
    WORD,
    Waiter,
    test_a_condition_already_true_returns_at_once,
    test_a_pending_wait_blocks_no_other_request,
    test_bad_waits_are_refused_with_typed_errors,
    test_deleting_the_region_ends_a_wait_with_extent_not_found,
    test_equals_waits_for_that_exact_value,
    test_every_mutating_operation_wakes_a_wait_on_its_word,
    test_many_waiters_are_woken_by_one_change,
    test_timeout_raises_timeout_and_the_server_stays_up,
    test_wait_returns_once_fetch_add_reaches_the_value,
)

pytestmark = pytest.mark.rdma
MiB = 1 << 20


@pytest.fixture
def transport():
    return "rdma"


@pytest.fixture
def client(cluster):
    with cluster.client(transport="rdma") as c:
        yield c


@pytest.fixture
def region(client, name):
    r = client.create_region(name, MiB, placement="single")
    assert set(r.transports().values()) == {"rdma"}
    yield r
    client.delete_region(name)


def test_rdma_accumulate_wakes_a_wait_and_one_sided_fetch_add_is_seen(region):
    w = Waiter(region, value=5, timeout=60)
    region.accumulate(WORD, np.array([2], np.int64))        # two-sided: the server applies it
    region.fetch_add(WORD, 3)                                # one-sided NIC atomic
    assert w.outcome() == 5


def test_collective_among_rdma_clients(cluster, name):
    """All-reduce and broadcast among clients whose data goes over rdma: the collective's
    PUSH/PULL travel on each server's tcp plane, as waits do; exact integer sums."""
    parties, n = 3, 20_000
    clients = [cluster.client(transport="rdma") for _ in range(parties)]
    colls = [Collective.create(clients[0], name, n * 8, parties, chunk_bytes=16 << 10, timeout=120)]
    colls += [Collective.open(c, name, parties, timeout=120, fresh=True) for c in clients[1:]]
    failures: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            for k in range(2):
                x = np.arange(n, dtype=np.int64) * (rank + 1) + k
                colls[rank].all_reduce(x)
                np.testing.assert_array_equal(x, np.arange(n, dtype=np.int64) * 6 + 3 * k)
            b = np.full(n, rank, np.int64)
            colls[rank].broadcast(b, root=2, rank=rank)
            np.testing.assert_array_equal(b, np.full(n, 2, np.int64))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(parties)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not failures, failures
        assert set(colls[0].region.transports().values()) == {"rdma"}     # the region's data path
        grads = clients[1].create_region(f"{name}-g", 1 << 20)
        grads.accumulate(0, np.ones(1 << 17, np.int64))
        np.testing.assert_array_equal(grads.read(0, 1 << 20, dtype="int64"), np.ones(1 << 17, np.int64))
        clients[1].delete_region(f"{name}-g")
    finally:
        for coll in colls[1:]:
            coll.close()
        colls[0].destroy()
        for c in clients:
            c.close()


def test_a_late_opener_among_rdma_clients_gets_exact_sums(cluster, name):
    """A party that opens the collective after a faster one pushed (the docs' way, no
    ``fresh``), with rdma clients: every round exact on both."""
    late_opener_sums_exactly(cluster, name, "rdma")
