"""Collectives run by several parties, each a client of its own (its own connections and
client id) in a thread of this process, against a local cluster; shared by the tcp, shm,
staging, CUDA and rdma tiers' collective tests."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from smb_client.collective import Collective
from smb_client.transports.stream import Reduction
from smb_protocol import errors
from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.dtypes import DType
from smb_protocol.rounds import ChunkRound
from smb_server.testing import rank_failures, run_ranks


def run_parties(cluster, name: str, parties: int, nbytes: int, chunk_bytes: int | None, transport: str | None,
                body, num_servers: int = 0, window: int | None = None, priority: bool = True,
                timeout: float = 60, expect_errors: bool = False, pipelined: bool = True,
                **options) -> list[BaseException]:
    """Run ``body(coll, rank)`` in ``parties`` threads; the first creates the collective
    (with ``options`` for :meth:`Collective.create`); every party's sends go through
    ``window`` bytes, lowest chunk first with ``priority`` (or as PUSH and PULL requests
    without ``pipelined``); clients of ``transport`` (None: the client's default). A
    party's failure fails the call; with ``expect_errors`` the failures are returned."""
    clients = [cluster.client(transport=transport) for _ in range(parties)]
    created = Collective.create(clients[0], name, nbytes, parties, chunk_bytes=chunk_bytes,
                                num_servers=num_servers, timeout=timeout, window=window, priority=priority,
                                pipelined=pipelined, **options)
    colls = [created] + [Collective.open(c, name, parties, timeout=timeout, window=window, priority=priority,
                                         pipelined=pipelined) for c in clients[1:]]

    def party(rank: int) -> None:
        body(colls[rank], rank)
    try:
        if expect_errors:
            return rank_failures(parties, party)
        run_ranks(parties, party)
        return []
    finally:
        for coll in colls[1:]:
            coll.close()
        created.destroy()
        for c in clients:
            c.close()


def chunks_per_server(coll: Collective) -> dict[str, int]:
    out: dict[str, int] = {}
    for chunk in coll.chunks:
        out[chunk.place.server_id] = out.get(chunk.place.server_id, 0) + 1
    return out


def summing_body(parties: int, n: int, seen: list[dict[str, int]]):
    """A party's body: three exact int64 sums; party 0 adds its chunks per server to ``seen``."""
    def body(coll: Collective, rank: int) -> None:
        if rank == 0:
            seen.append(chunks_per_server(coll))
        for k in range(3):
            x = np.arange(n, dtype=np.int64) * (rank + 1) + k
            coll.all_reduce(x)
            np.testing.assert_array_equal(
                x, np.arange(n, dtype=np.int64) * (parties * (parties + 1) // 2) + k * parties)
    return body


def after_each_push(coll: Collective, fn) -> None:
    """Run ``fn(task)`` on the stream's receiving thread each time one of ``coll``'s
    pushes took effect (mid-round, with sums still owed)."""
    ex = coll.exchanger
    assert ex is not None
    pushed = ex._pushed

    def after(task) -> None:
        pushed(task)
        fn(task)
    ex._pushed = after   # type: ignore[method-assign]


def break_mid_round(cluster, name: str, transport: str) -> None:
    """Party 0's stream connections (queue pairs over rdma) are cut three times mid-round
    of three parties, right after a push took effect and with sums still owed: the
    chunks in flight go again with their numbers, and the servers apply none of them
    twice (the exact sums would show it: a chunk sent again after its sum came back
    would add the sum)."""
    breaks: list[int] = []

    def cut(task) -> None:
        if len(breaks) < 3 and task.chunk.index % 7 == 3 and task.stream is not None:
            breaks.append(task.chunk.index)
            task.stream.abandon()

    def body(coll: Collective, rank: int) -> None:
        if rank == 0:
            after_each_push(coll, cut)
        summing_body(3, 40 * 512, [])(coll, rank)
    run_parties(cluster, name, 3, 40 * 512 * 8, 4096, transport, body, num_servers=2, window=4 * 4096)
    assert len(breaks) == 3


def kill_mid_round(cluster, name: str, transport: str, within: float, wire: str | None = None,
                   refused_after: bool = True) -> None:
    """kill -9 of ``cluster``'s memory server 0 in the middle of a round of three parties:
    every party gets a typed error naming the server (it is unavailable) within ``within``
    seconds of the kill, well before the collective's own timeout, and none hangs; with
    ``refused_after``, the collective refuses another round (its counts are unknown).
    Chunks travel as ``wire`` values when given."""
    killed = threading.Event()
    killed_at: list[float] = []
    ended: dict[int, float] = {}
    seen: dict[int, BaseException] = {}

    def kill(task) -> None:
        if task.chunk.index == 20 and not killed.is_set():
            killed_at.append(time.monotonic())
            killed.set()
            cluster.kill_server(0)

    def body(coll: Collective, rank: int) -> None:
        if rank == 0:
            after_each_push(coll, kill)
        x = np.ones(200 * 512, np.int64) if wire is None else np.ones(400 * 512, np.float32)
        try:
            for _ in range(3):
                coll.all_reduce(x, wire=wire)
        except errors.SMBError as exc:
            ended[rank] = time.monotonic()
            seen[rank] = exc
            if refused_after:
                with pytest.raises(type(exc), match="failed in round"):
                    coll.all_reduce(x, wire=wire)
            raise
    failures = run_parties(cluster, name, 3, 200 * 512 * 8, 4096, transport, body, num_servers=2,
                           window=8 * 4096, timeout=120, expect_errors=True)
    assert killed.is_set()
    assert len(failures) == 3 and sorted(seen) == [0, 1, 2], failures
    for exc in seen.values():
        assert isinstance(exc, errors.Unavailable) and not isinstance(exc, errors.Timeout), exc
    # the kernel closes a killed server's connections: no party waits for a timeout
    assert max(ended.values()) - killed_at[0] < within, (ended, killed_at)
    server = cluster.server_id(0)
    assert all(server in str(exc) for exc in seen.values()), seen


def stream_threads_end_with_the_clients(cluster, name: str, transport: str, prefix: str) -> None:
    """A client's close ends the threads (named ``prefix ...``) that take in its
    collective's sums before it returns: one still running could free the last reference
    to a caller's buffer (a torch tensor's memory) as the interpreter shuts down, which
    aborts the process ("terminate called without an active exception")."""
    def threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(prefix)}

    before = threads()

    def body(coll: Collective, rank: int) -> None:
        x = np.arange(4096, dtype=np.int64)
        coll.all_reduce(x)
        assert threads() - before   # the sums came through such a thread
    run_parties(cluster, name, 2, 4096 * 8, 4096, transport, body)
    assert not threads() - before, threads() - before


def a_close_while_connecting_wins(cluster, name: str, transport: str, prefix: str, remake) -> None:
    """A close that lands while a REDUCE stream connects (after the stream saw itself
    open, before it recorded the link) wins: the connection it made is closed, the REDUCE
    fails with a typed error, and no thread named ``prefix`` is left to outlive the close.
    ``remake(session, connect)``: a stream of the session's kind over ``connect``, named
    "closing stream"."""
    with cluster.client(transport=transport) as c:
        r = c.create_region(name, 4096)
        r.write(0, np.zeros(512, np.int64))                       # opens the session
        session = next(s for s in c.dataplane.sessions().values() if s.scheme == transport)
        connect = session.reductions()._connect
        made = []

        def connect_then_closed():
            conn = connect()
            made.append(conn)
            stream.close()                  # the close lands between the check and the record
            return conn
        stream = remake(session, connect_then_closed)
        outcome: list[errors.SMBError | None] = []
        x = np.arange(256, dtype=np.int64)                       # a slot of 2 KiB, its word at the end
        stream.send(r.route.ticket, Reduction(r.extents[0].extent_id, 0, [memoryview(x).cast("B")],
                                              ChunkTypes(DType.INT64), ChunkRound(4096 - 8, 1, 0), 5.0, 0,
                                              lambda: None, outcome.append))
        assert len(outcome) == 1 and isinstance(outcome[0], errors.ServerUnavailable), outcome
        assert "closed" in str(outcome[0])
        assert made and made[0].closed                            # the connection it made is closed
        assert not [t for t in threading.enumerate() if t.name == f"{prefix} closing stream"]
        assert stream.in_flight() == 0
        c.delete_region(name)
