"""Collectives on the memory servers: pipelined push-pull all_reduce and broadcast.

Each party is a client of its own (its own connections and client id) in a thread of
this process, against the shared local cluster (two memory servers). Integer data, so
sums are exact; every party checks every element.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from smb_client.collective import TAIL, Collective
from smb_client.transports.stream import ReduceStream
from smb_protocol import errors
from tests.integration.client.parties import (
    a_close_while_connecting_wins,
    break_mid_round,
    kill_mid_round,
    run_parties,
    stream_threads_end_with_the_clients,
    summing_body,
)

KiB = 1 << 10


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("parties,chunk_bytes,n", [(1, 4096, 1000), (2, 4096, 5000), (3, 64 * KiB, 100_000),
                                                   (4, 8 * KiB, 33_333)])
def test_all_reduce_sums_exactly_round_after_round(cluster, name, transport, parties, chunk_bytes, n):
    def body(coll: Collective, rank: int) -> None:
        for k in range(5):                     # both slots, each reused twice
            x = np.arange(n, dtype=np.int64) * (rank + 1) + k
            assert coll.all_reduce(x) is x
            expect = np.arange(n, dtype=np.int64) * (parties * (parties + 1) // 2) + k * parties
            np.testing.assert_array_equal(x, expect)
    run_parties(cluster, name, parties, n * 8, chunk_bytes, transport, body)


def test_a_tcp_streams_answers_are_read_natively_and_nothing_stays_registered(cluster, name):
    """Every stream of a round over tcp reads its answers with the native reader
    (``answers.c``), and once the round is over no request's buffers are held there."""
    def body(coll: Collective, rank: int) -> None:
        for k in range(3):
            x = np.full(20_000, rank + k, np.int64)
            coll.all_reduce(x)
            np.testing.assert_array_equal(x, np.full(20_000, 1 + 2 * k, np.int64))
        streams = {id(s): s for s in (coll.region.route.stream(c.slot, True)[0] for c in coll.chunks)}
        assert len(streams) == 2                       # one per server
        for stream in streams.values():
            assert isinstance(stream, ReduceStream)
            link = stream._link
            assert link is not None
            assert link.answers.expected() == 0 and stream.in_flight() == 0
    run_parties(cluster, name, 2, 20_000 * 8, 16 * KiB, "tcp", body)


def test_all_reduce_float32_and_a_shorter_buffer(cluster, name):
    def body(coll: Collective, rank: int) -> None:
        x = np.full(3000, rank + 0.5, np.float32)
        coll.all_reduce(x)
        np.testing.assert_array_equal(x, np.full(3000, 0.5 + 1.5 + 2.5, np.float32))
        y = np.full(100, rank, np.int32)          # fewer bytes than the collective holds
        coll.all_reduce(y)
        np.testing.assert_array_equal(y, np.full(100, 3, np.int32))
    run_parties(cluster, name, 3, 3000 * 4, 2048, "tcp", body)


def test_broadcast_between_all_reduces(cluster, name):
    def body(coll: Collective, rank: int) -> None:
        for k in range(4):
            root = k % 3
            b = np.full(2500, rank * 100 + k, np.int64)
            coll.broadcast(b, root=root, rank=rank)
            np.testing.assert_array_equal(b, np.full(2500, root * 100 + k, np.int64))
            x = np.full(2500, rank + k, np.int64)
            coll.all_reduce(x)
            np.testing.assert_array_equal(x, np.full(2500, 3 + 3 * k, np.int64))
    run_parties(cluster, name, 3, 2500 * 8, 4096, "tcp", body)


def test_chunks_are_spread_over_the_servers(cluster, name):
    with cluster.client() as c:
        coll = Collective.create(c, name, 10 * 4096, 2, chunk_bytes=4096)
        try:
            assert len(coll.chunks) == 10
            per_server = {}
            for chunk in coll.chunks:
                per_server[chunk.place.server_id] = per_server.get(chunk.place.server_id, 0) + 1
            assert sorted(per_server.values()) == [5, 5]
            assert coll.region.size == 10 * (2 * 4096 + TAIL)
        finally:
            coll.destroy()


def test_bad_arguments_are_typed_errors(cluster, name):
    with cluster.client() as c:
        with pytest.raises(errors.InvalidArgument, match="chunk_bytes"):
            Collective.create(c, name, 1000, 2, chunk_bytes=5 << 20)
        with pytest.raises(errors.InvalidArgument, match="parties"):
            Collective.create(c, name, 1000, 0)
        coll = Collective.create(c, name, 1024, 1, chunk_bytes=512)
        try:
            with pytest.raises(errors.InvalidArgument, match="do not fit"):
                coll.all_reduce(np.zeros(200, np.int64))
            with pytest.raises(errors.DtypeError):
                coll.all_reduce(bytearray(16))
            with pytest.raises(errors.InvalidArgument, match="root"):
                coll.broadcast(np.zeros(4, np.int64), root=1, rank=0)
            c.create_region(name + "x", 4096).close()
            with pytest.raises(errors.InvalidArgument, match="not a collective"):
                Collective.open(c, name + "x", 2)
            c.delete_region(name + "x")
        finally:
            coll.destroy()


def test_a_party_that_never_comes_times_out(cluster, name):
    with cluster.client() as c:
        coll = Collective.create(c, name, 4096, 2, chunk_bytes=4096, timeout=0.5)
        try:
            with pytest.raises(errors.Timeout):
                coll.all_reduce(np.zeros(512, np.int64))
        finally:
            coll.destroy()


def test_a_party_opening_after_a_faster_one_pushed_takes_fresh_counts(cluster, name):
    """SyncDataParallel's case: rank 0 creates the collective and goes straight on; a
    party that opens it later with fresh=True starts from zero counts, not from the
    count rank 0's push left."""
    with cluster.client() as a, cluster.client() as b:
        first = Collective.create(a, name, 8 * 1024, 2, chunk_bytes=4096, timeout=30)
        x = np.full(1024, 5, np.int64)
        t = threading.Thread(target=first.all_reduce, args=(x,))
        t.start()
        time.sleep(0.5)                                   # its pushes are in, its pulls wait
        second = Collective.open(b, name, 2, timeout=30, fresh=True)
        y = np.full(1024, 7, np.int64)
        second.all_reduce(y)
        t.join(30)
        np.testing.assert_array_equal(x, np.full(1024, 12, np.int64))
        np.testing.assert_array_equal(y, np.full(1024, 12, np.int64))
        second.close()
        first.destroy()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_weighted_servers_get_their_share_of_chunks_and_sums_stay_exact(cluster, name, transport):
    with cluster.client() as c:
        a, b = sorted(s.server_id for s in c.list_servers() if s.state == "up")[:2]
    seen: list[dict[str, int]] = []
    n = 40 * 512                                  # 40 chunks of 4 KiB
    run_parties(cluster, name, 3, n * 8, 4096, transport, summing_body(3, n, seen), servers={a: 3, b: 1})
    assert seen == [{a: 30, b: 10}]


def test_worker_hosts_and_explicit_servers_choose_where_the_chunks_go(cluster, name):
    from smb_protocol.hostinfo import host_id
    with cluster.client() as c:
        ids = sorted(s.server_id for s in c.list_servers() if s.state == "up")
    seen: list[dict[str, int]] = []
    n = 20 * 512
    # one server named: every chunk on it, whatever the hosts
    run_parties(cluster, name, 2, n * 8, 4096, "tcp", summing_body(2, n, seen),
             servers=[ids[1]], worker_hosts=[host_id(), "elsewhere"])
    assert seen == [{ids[1]: 20}]
    # both servers share this host, which runs one of the three workers: an even split
    # of the host's share (the default chunk size gives both several chunks)
    seen.clear()
    run_parties(cluster, name, 3, n * 8, None, "tcp", summing_body(3, n, seen),
             worker_hosts=[host_id(), "elsewhere-1", "elsewhere-2"])
    assert set(seen[0]) == set(ids) and max(seen[0].values()) - min(seen[0].values()) <= 1


def test_placement_arguments_are_checked(cluster, name):
    with cluster.client() as c:
        with pytest.raises(errors.InvalidArgument, match="exclude"):
            Collective.create(c, name, 4096, 2, num_servers=1, servers=[c.list_servers()[0].server_id])
        with pytest.raises(errors.InvalidArgument, match="not up"):
            Collective.create(c, name, 4096, 2, servers=["no-such-server"])
        with pytest.raises(errors.InvalidArgument, match="weight"):
            Collective.create(c, name, 4096, 2, servers={"x": -1})
        with pytest.raises(errors.OutOfMemory, match="not up"):
            c.create_region(name, 4096, placement="layered", server_weights={"no-such-server": 1})
        with pytest.raises(errors.InvalidArgument, match="layered"):
            c.create_region(name, 4096, server_weights={"x": 1})


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("window,priority,num_servers", [
    (1, True, 1),               # one chunk in flight at a time, every chunk on one server
    (3 * 4096, False, 2),       # three chunks, in the order they were handed in
    (1 << 30, True, 2),         # everything at once
    (8192, True, 0),            # every server that is up
])
def test_any_window_order_and_placement_sums_exactly(cluster, name, transport, window, priority, num_servers):
    n = 25 * 512                                  # 25 chunks of 4 KiB
    run_parties(cluster, name, 3, n * 8, 4096, transport, summing_body(3, n, []), num_servers=num_servers,
             window=window, priority=priority)


def test_sums_stream_back_on_pipelined_connections(cluster, name):
    """Every chunk travels as one REDUCE on the collective's streams: one connection per
    server, no pushes and pulls on pooled connections."""
    def body(coll: Collective, rank: int) -> None:
        assert coll.streaming and coll.exchanger is not None
        summing_body(2, 16 * 512, [])(coll, rank)
        streams = {id(s): s for s in (coll.region.route.dataplane.coordination(c.place).reductions()
                                      for c in coll.chunks)}
        assert len(streams) == len({c.place.server_id for c in coll.chunks}) == 2
        assert all(s.in_flight() == 0 for s in streams.values())
    run_parties(cluster, name, 2, 16 * 512 * 8, 4096, "tcp", body, num_servers=2)


def test_a_round_whose_connections_break_is_sent_again_and_adds_nothing_twice(cluster, name):
    """Party 0's stream connections are cut three times mid-round, right after a push took
    effect and with sums still owed: the chunks in flight go again with their numbers,
    the servers apply none of them twice (the sums would show it: a chunk sent again
    after its sum came back would add the sum)."""
    break_mid_round(cluster, name, "tcp")


@pytest.mark.parametrize("wire", [None, "bf16"])
def test_a_server_killed_mid_round_fails_every_party_with_a_typed_error(fresh_cluster, name, wire):
    """kill -9 of a memory server in the middle of a round: every party gets a typed
    error (the server is unavailable), well before the collective's own timeout, none
    hangs, and the collective refuses another round (its counts are unknown); the same
    with chunks that travel in a wire type."""
    kill_mid_round(fresh_cluster, name, "tcp", within=20, wire=wire)


def test_closing_the_clients_waits_for_their_receiving_threads(cluster, name):
    stream_threads_end_with_the_clients(cluster, name, "tcp", "smb-reduce")


def test_a_stream_closed_while_it_connects_keeps_neither_connection_nor_thread(cluster, name):
    a_close_while_connecting_wins(cluster, name, "tcp", "smb-reduce",
                                  lambda session, connect: ReduceStream(connect, "closing stream"))
