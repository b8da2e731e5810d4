"""Collectives over RDMA (Soft-RoCE, real verbs): a region opened over rdma moves its
chunks by RDMA WRITE into the servers' staging areas and gets its sums written back
into the caller's buffers; no request of the round reaches a server's tcp plane.

The tcp tier's collective tests (tests/integration/client/test_collective.py,
test_collective_wire.py) run here over rdma with the same helpers: exact sums under
every window, order and placement, broadcasts, 16-bit chunks, connections cut mid-round,
and a server killed mid-round.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from smb_client.collective import Collective
from smb_client.transports.rdma.reduce import RdmaReduceStream
from smb_protocol import errors
from tests.integration.client.parties import (
    a_close_while_connecting_wins,
    break_mid_round,
    kill_mid_round,
    run_parties,
    stream_threads_end_with_the_clients,
    summing_body,
)
from tests.integration.daemons import scrape
from tests.rdma.conftest import rdma_cluster


@pytest.fixture(scope="module")
def cluster():
    """Two rdma memory servers that serve Prometheus metrics (to count tcp requests)."""
    with rdma_cluster(2, "256M", "collective-", metrics=True) as c:
        yield c


def _streams(coll: Collective) -> list[object]:
    return list({id(s): s for s in (coll.region.route.stream(c.slot)[0] for c in coll.chunks)}.values())


@pytest.mark.parametrize("parties,chunk_bytes,n", [(2, 4096, 40 * 512), (3, None, 100_000)])
def test_all_reduce_over_rdma_sums_exactly_round_after_round(cluster, name, parties, chunk_bytes, n):
    def body(coll: Collective, rank: int) -> None:
        streams = _streams(coll)
        assert streams and all(isinstance(s, RdmaReduceStream) for s in streams), streams
        summing_body(parties, n, [])(coll, rank)
        assert all(s.in_flight() == 0 for s in streams)
    run_parties(cluster, name, parties, n * 8, chunk_bytes, "rdma", body)


@pytest.mark.parametrize("window,priority,num_servers", [(4096, True, 1), (3 * 4096, False, 2)])
def test_any_window_order_and_placement_sums_exactly_over_rdma(cluster, name, window, priority, num_servers):
    n = 30 * 512
    run_parties(cluster, name, 3, n * 8, 4096, "rdma", summing_body(3, n, []), num_servers=num_servers,
             window=window, priority=priority)


def test_broadcast_and_float32_over_rdma(cluster, name):
    def body(coll: Collective, rank: int) -> None:
        x = np.full(20_000, rank + 1, np.float32)
        coll.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(20_000, 6, np.float32))
        y = np.arange(10_000, dtype=np.int64) if rank == 1 else np.zeros(10_000, np.int64)
        coll.broadcast(y, root=1, rank=rank)
        np.testing.assert_array_equal(y, np.arange(10_000, dtype=np.int64))
    run_parties(cluster, name, 3, 20_000 * 4, 4096, "rdma", body)


@pytest.mark.parametrize("wire,full_sum", [("bf16", False), ("fp16", True)])
def test_sixteen_bit_chunks_over_rdma_sum_in_32_bits(cluster, name, wire, full_sum):
    """Chunks narrowed for the wire go through the stream's bounce ring; the server
    widens them and sums in float32 (the values are exact in both types)."""
    def body(coll: Collective, rank: int) -> None:
        x = np.arange(8192, dtype=np.float32) % 64 * (rank + 1)
        coll.all_reduce(x, wire=wire, full_sum=full_sum)
        np.testing.assert_array_equal(x, np.arange(8192, dtype=np.float32) % 64 * 3)
    run_parties(cluster, name, 2, 8192 * 4, 4096, "rdma", body)


def _tcp_requests(cluster) -> dict[str, float]:
    """Every server's count of tcp-plane operations, by server."""
    out = {}
    for i in range(len(cluster.servers)):
        port = json.loads((cluster.workdir / f"server-{i}" / "ready").read_text())["metrics_port"]
        samples = scrape(port)
        out[str(i)] = sum(v for (metric, labels), v in samples.items()
                          if metric == "smb_server_operations_total" and dict(labels).get("transport") == "tcp")
    return out


def test_no_tcp_request_in_a_round_over_rdma(cluster, name):
    """Rounds over rdma: the servers' tcp planes serve none of their requests, and the
    parties open no tcp data connection for them."""
    parties, n = 2, 64 * 512
    made = threading.Barrier(parties)
    counts: dict[str, dict[str, float]] = {}

    def body(coll: Collective, rank: int) -> None:
        x = np.arange(n, dtype=np.int64)
        coll.all_reduce(x)     # the first round registers the buffers and connects
        made.wait(30)
        if rank == 0:
            counts["before"] = _tcp_requests(cluster)
        made.wait(30)
        for k in range(3):
            x = np.arange(n, dtype=np.int64) + k
            coll.all_reduce(x)
            np.testing.assert_array_equal(x, (np.arange(n, dtype=np.int64) + k) * parties)
        made.wait(30)
        if rank == 0:
            counts["after"] = _tcp_requests(cluster)
        tcp = coll.region.route.dataplane._sessions
        assert not [uri for uri in tcp if uri.startswith("tcp://")], tcp
    run_parties(cluster, name, parties, n * 8, 4096, "rdma", body, num_servers=2)
    assert counts["before"] == counts["after"], counts


def test_a_round_whose_queue_pairs_break_is_sent_again_and_adds_nothing_twice(cluster, name):
    """Party 0's queue pairs are cut three times mid-round, right after a push took
    effect and with sums still owed: the chunks in flight go again with their numbers
    on new queue pairs, and the servers apply none of them twice."""
    break_mid_round(cluster, name, "rdma")


def test_transport_tcp_keeps_the_exchange_on_tcp(cluster, name):
    """``transport="tcp"`` sends the chunks of a region whose data goes over rdma through
    the servers' tcp planes; an unknown transport is refused."""
    with cluster.client(transport="rdma") as c:
        coll = Collective.create(c, name, 8192, 1, chunk_bytes=4096, transport="tcp")
        try:
            before = _tcp_requests(cluster)
            x = np.arange(1024, dtype=np.int64)
            coll.all_reduce(x)
            np.testing.assert_array_equal(x, np.arange(1024, dtype=np.int64))
            assert sum(_tcp_requests(cluster).values()) > sum(before.values())
            with pytest.raises(errors.InvalidArgument, match="transport"):
                Collective.open(c, name, 1, transport="udp")
        finally:
            coll.destroy()


def test_closing_the_clients_waits_for_their_polling_threads(cluster, name):
    stream_threads_end_with_the_clients(cluster, name, "rdma", "smb-rdma-reduce")


def test_a_stream_closed_while_it_connects_keeps_neither_queue_pair_nor_thread(cluster, name):
    a_close_while_connecting_wins(cluster, name, "rdma", "smb-rdma-reduce", lambda session, connect: RdmaReduceStream(
        connect, session.shared.remote_cache, "closing stream"))


def test_a_server_killed_mid_round_over_rdma_fails_every_party_with_a_typed_error(cluster, name):
    """kill -9 of a memory server mid-round: every party gets a typed error naming the
    server, well before the collective's timeout; none hangs. (Last in this module: the
    server is started again afterwards, on the module's cluster.)"""
    try:
        kill_mid_round(cluster, name, "rdma", within=30, refused_after=False)
    finally:
        cluster.start_server(0)
        cluster.wait_servers(2)
