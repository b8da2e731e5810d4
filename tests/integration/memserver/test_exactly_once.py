"""Exactly-once mutations: a retried request is never applied twice.

Three ways a request runs again, each against real sockets and a real memory-server plane:
the same numbered request sent twice by hand; a connection cut (by a proxy on loopback)
part way through an accumulate's payload or before a fetch_add's answer, which the
client's tcp session sends again on a new connection; and a ticket that expires in the
middle of a many-request operation (a client clock that lags), which the region renews
before running the operation again, on tcp and on shm against a real local cluster.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from smb_protocol import tickets, wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import InvalidArgument, Status
from smb_protocol.rounds import ChunkRound
from smb_protocol.wire import Op
from smb_server.memserver.scratch import SCRATCH_BYTES
from smb_server.testing import wait_until
from tests.integration.memserver.planes import _hello, _request, _session, _ticket

MiB = 1 << 20


def test_a_repeated_numbered_request_gets_its_first_answer_and_applies_once(plane):
    arena, tcp, stats = plane
    ones = np.ones(1024, np.int64).tobytes()
    with socket.create_connection(("127.0.0.1", tcp.port)) as a, \
            socket.create_connection(("127.0.0.1", tcp.port)) as b:
        _hello(a, _ticket([1]))
        _hello(b, _ticket([1]))
        first = _request(a, 2, Op.FETCH_ADD, 1, 0, 8, arg0=5, seq=100)
        again = _request(b, 2, Op.FETCH_ADD, 1, 0, 8, arg0=5, seq=100)   # another connection
        assert first == again == (Status.OK, struct.pack("<q", 0))
        for sock in (a, b, a):
            assert _request(sock, 3, Op.ACCUMULATE, 1, 4096, len(ones), int(DType.INT64), payload=ones,
                            seq=200)[0] == Status.OK
        # the connection is still in step after a repeat's payload was discarded
        assert _request(a, 4, Op.READ, 1, 4096, 16) == (Status.OK, np.ones(2, np.int64).tobytes())
        # a number reused for a different request is refused, not answered for the wrong one
        status, body = _request(a, 5, Op.FETCH_ADD, 1, 8, 8, arg0=1, seq=100)
        assert status == Status.INVALID_ARGUMENT and b"names one request" in body
    data = arena.get(1).data
    assert struct.unpack("<q", bytes(data[0:8]))[0] == 5
    assert np.array_equal(np.frombuffer(bytes(data[4096:4096 + len(ones)]), np.int64), np.ones(1024, np.int64))
    assert stats.snapshot()["repeats"] == 3
    # unnumbered requests (seq 0) are not tracked: each one applies
    with socket.create_connection(("127.0.0.1", tcp.port)) as c:
        _hello(c, _ticket([1]))
        for _ in range(2):
            assert _request(c, 2, Op.FETCH_ADD, 1, 0, 8, arg0=1)[0] == Status.OK
    assert struct.unpack("<q", bytes(data[0:8]))[0] == 7
    assert InvalidArgument  # the refusal above maps to this class on the client


class CuttingProxy:
    """A loopback TCP proxy to ``port`` that cuts its first connection once
    ``up_limit`` bytes went client -> server or ``down_limit`` bytes server -> client
    (whichever is set), then forwards later connections whole."""

    def __init__(self, port: int, up_limit: int | None = None, down_limit: int | None = None) -> None:
        self.target = port
        self.limits = (up_limit, down_limit)
        self.cuts = 0
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._first = True
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._lsock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [down, up]
            limits = self.limits if self._first else (None, None)
            self._first = False
            done = threading.Event()
            threading.Thread(target=self._pump, args=(down, up, limits[0], done), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, limits[1], done), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None, done: threading.Event) -> None:
        moved = 0
        try:
            while not done.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if limit is not None and moved + len(data) > limit:
                    dst.sendall(data[:limit - moved])
                    self.cuts += 1
                    break
                dst.sendall(data)
                moved += len(data)
        except OSError:
            pass
        done.set()
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._lsock.close()
        for s in self._socks:
            s.close()


def test_an_accumulate_cut_mid_payload_resumes_on_a_new_connection(plane):
    arena, tcp, stats = plane
    token = _ticket([1])
    hello = wire.REQUEST.size + len(token)
    applied_before_cut = 2 * SCRATCH_BYTES           # two scratch chunks in, then the cut
    proxy = CuttingProxy(tcp.port, up_limit=hello + wire.REQUEST.size + applied_before_cut + MiB)
    session = _session(proxy.port)
    try:
        ones = np.ones(16 * MiB // 8, np.int64)
        session.accumulate(token, 1, 0, [memoryview(ones).cast("B")], DType.INT64, seq=7 << 20)
    finally:
        session.close()
        proxy.close()
    assert proxy.cuts == 1
    got = np.frombuffer(bytes(arena.get(1).data[:16 * MiB]), np.int64)
    assert np.array_equal(got, ones)                 # every element exactly once
    assert stats.snapshot()["bytes_accumulated"] == 16 * MiB


def test_a_fetch_add_whose_answer_was_lost_is_not_applied_again(plane):
    arena, tcp, stats = plane
    proxy = CuttingProxy(tcp.port, down_limit=wire.RESPONSE.size)   # HELLO's answer passes, no more
    session = _session(proxy.port)
    try:
        old = session.fetch_add(_ticket([1]), 1, 64, 5, seq=9 << 20)
    finally:
        session.close()
        proxy.close()
    assert proxy.cuts == 1 and old == 0
    assert struct.unpack("<q", bytes(arena.get(1).data[64:72]))[0] == 5
    assert stats.snapshot()["repeats"] == 1


def test_an_unnumbered_request_whose_connection_broke_is_not_sent_again(plane):
    arena, tcp, _stats = plane
    proxy = CuttingProxy(tcp.port, down_limit=wire.RESPONSE.size)
    session = _session(proxy.port)
    try:
        with pytest.raises(Exception, match="tcp://127.0.0.1"):
            session.fetch_add(_ticket([1]), 1, 64, 5)     # seq 0: the server may have applied it
    finally:
        session.close()
        proxy.close()
    applied = wait_until(lambda: struct.unpack("<q", bytes(arena.get(1).data[64:72]))[0], "the fetch_add to apply")
    assert applied == 5                                   # applied once, not retried


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_an_operation_whose_ticket_expires_part_way_is_applied_exactly_once(cluster, name, transport):
    """A client whose clock lags: its ticket expires at the servers in the middle of a
    64-request accumulate. The region renews it and runs the operation again; the
    requests that took effect are answered with their first answer."""
    secret = bytes.fromhex(cluster.secret_file.read_text().strip())
    n = 16 * MiB // 8
    requests = 16 * MiB // (256 << 10)
    with cluster.client(transport=transport, chunk_bytes=256 << 10, io_threads=4) as c:
        r = c.create_region(name, 16 * MiB, stripe_unit=256 << 10)
        r.write(0, np.zeros(n, np.int64))                          # opens the sessions
        expired = tickets.sign(secret, r.uid, [p.extent_id for p in r.extents], "rw", ttl=-1)[0]
        sessions = [s for s in c.dataplane.sessions().values() if s.scheme == transport]
        for round_ in range(1, 4):
            r.route.expires_at = time.time() + 3600                     # the client thinks it is fresh
            calls = _expire_after(sessions, r, expired, after=8 * round_)
            try:
                r.accumulate(0, np.arange(n, dtype=np.int64))
            finally:
                for s in sessions:
                    del s.accumulate                               # the session's own method again
            assert calls[0] > requests                             # it ran again after the expiry
            got = r.read(0, 16 * MiB, dtype="int64")
            assert np.array_equal(got, np.arange(n, dtype=np.int64) * round_)
        c.delete_region(name)


def _expire_after(sessions, region, expired: str, after: int) -> list[int]:
    """Count the sessions' accumulate requests; from the ``after``-th on, the region holds
    an expired ticket, once (the region's renewal then replaces it). Returns the count."""
    calls = [0]
    lock = threading.Lock()
    for session in sessions:
        inner = session.accumulate

        def expiring(*args, inner=inner, **kwargs):
            with lock:
                calls[0] += 1
                if calls[0] == after:
                    region.route.ticket = expired
            return inner(*args, **kwargs)
        session.accumulate = expiring
    return calls


def test_a_collective_pull_whose_answer_was_cut_is_sent_again_and_counted_once(plane):
    """PULL counts the read once it sent the bytes; its retry (same number) gets the bytes
    again and counts nothing, so the slot's count stays right for the next round."""
    arena, tcp, stats = plane
    token = _ticket([1])
    direct = _session(tcp.port)
    data = np.arange(1024, dtype=np.int64)
    word = 2 * data.nbytes
    ref = ChunkRound(word, 1, 0)
    assert direct.push(token, 1, 0, [memoryview(data).cast("B")], DType.INT64, ref, 5.0, seq=1 << 20) == 0
    direct.close()
    proxy = CuttingProxy(tcp.port, down_limit=wire.RESPONSE.size + wire.RESPONSE.size + 100)
    session = _session(proxy.port)
    out = np.zeros_like(data)
    try:
        session.pull(token, 1, 0, [memoryview(out).cast("B")], ref, 5.0, seq=2 << 20)
    finally:
        session.close()
        proxy.close()
    assert proxy.cuts == 1
    np.testing.assert_array_equal(out, data)
    assert struct.unpack("<q", bytes(arena.get(1).data[word:word + 8]))[0] == ref.end   # one push, one pull
    assert stats.snapshot()["repeats"] == 1
