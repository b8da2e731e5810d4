"""A flood of connections that never authenticate, from the client's own address, against
a real ``smb server`` process: the client is delayed, never locked out.

Every connection that has not presented a valid ticket counts against a budget of its
own (``tcp_connections_unauthenticated``), never against the per-peer and total limits
of authenticated connections; a full budget evicts its oldest member. The latencies of
the client's operations before and during the flood are printed (run with ``-s``); no
assertion depends on them.
"""
from __future__ import annotations

import resource
import socket
import statistics
import threading
import time

import numpy as np

from smb_protocol.errors import ServerBusy
from smb_server.commands.local_cluster import LocalCluster

FLOOD = 2000             # idle connections that never send a byte
KiB = 1 << 10
FRESH_TRIES = 20         # attempts a fresh client may need (each is evicted only by bad luck)


def raise_nofile(need: int) -> None:
    """Lift this process's soft descriptor limit to at least ``need`` (up to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        limit = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return (f"{name}: {len(ms)} ops, median {statistics.median(ms):.2f} ms, "
            f"p99 {ms[int(len(ms) * 0.99) - 1]:.2f} ms, max {ms[-1]:.2f} ms")


def test_a_flood_of_unauthenticated_connections_never_locks_out_a_client(tmp_path):
    raise_nofile(FLOOD + 1024)
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"),
                      transports="tcp", log_level="WARNING") as cluster:
        with cluster.client() as client:
            (server,) = client.list_servers()
            port = int(next(e for e in server.endpoints if e.startswith("tcp://")).rpartition(":")[2])
            region = client.create_region("flood/region", 64 * KiB, placement="single")
            data = np.arange(4 * KiB // 4, dtype=np.int32)
            back = np.zeros_like(data)

            def op(i: int) -> float:
                start = time.perf_counter()
                region.write(0, data + i)
                region.read_into(0, back)
                took = time.perf_counter() - start
                np.testing.assert_array_equal(back, data + i)
                return took

            before = [op(i) for i in range(200)]

            flood: list[socket.socket] = []
            opened = threading.Event()
            failure: list[BaseException] = []

            def open_flood() -> None:
                try:
                    for _ in range(FLOOD):
                        flood.append(socket.create_connection(("127.0.0.1", port), timeout=30))
                except BaseException as exc:   # reported by the test below
                    failure.append(exc)
                finally:
                    opened.set()

            opener = threading.Thread(target=open_flood, name="flood")
            opener.start()
            during: list[float] = []
            fresh: list[tuple[float, int]] = []   # (seconds, attempts) of new clients
            try:
                i = 0
                while not opened.is_set() or len(during) < 200:
                    during.append(op(i))
                    i += 1
                    if i % 100 == 0 and len(fresh) < 5:   # a new client joins meanwhile
                        fresh.append(join(cluster))
                opener.join()
                assert not failure, f"opening the flood failed: {failure[0]!r}"
                assert len(flood) == FLOOD
                fresh.append(join(cluster))     # and once every flood connection is open
                after = [op(i) for i in range(200)]
            finally:
                opened.wait()
                opener.join()
                for sock in flood:
                    sock.close()
            region.write(0, data)
            np.testing.assert_array_equal(region.read(0, data.nbytes, dtype="int32"), data)
    print()
    print(summary("write+read of 4 KiB, before the flood", before))
    print(summary(f"the same while {FLOOD} unauthenticated connections open", during))
    print(summary("the same once they are all open", after))
    print("new clients during the flood (connect, HELLO, read): " + ", ".join(
        f"{s * 1e3:.1f} ms in {n} attempt(s)" for s, n in fresh))


def join(cluster: LocalCluster) -> tuple[float, int]:
    """A new client opens the region and reads it over new connections: (seconds,
    attempts). An attempt may only fail as an eviction (``ServerBusy``) and is retried."""
    start = time.perf_counter()
    for attempt in range(1, FRESH_TRIES + 1):
        try:
            with cluster.client() as other:
                other.open_region("flood/region").read(0, 16)
            return time.perf_counter() - start, attempt
        except ServerBusy as exc:
            assert "before it authenticated" in str(exc), exc
    raise AssertionError(f"a new client was evicted {FRESH_TRIES} times in a row")
