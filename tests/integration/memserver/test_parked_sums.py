"""Sums owed to REDUCE requests are sent by the push that completes their round
(smb_server/memserver/tcp_sums.py, native/serve.c): a party whose socket is full (it stopped
reading) must not hold up the party whose pushes complete the rounds, and a parked sum
whose round never completes is answered with a typed Timeout. Raw frames against a
real tcp plane and arena in this process."""
from __future__ import annotations

import socket

import numpy as np

from smb_protocol import wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import Status
from smb_protocol.rounds import ChunkRound
from smb_protocol.wire import Op
from smb_server.memserver import _native
from smb_server.testing import wait_until
from tests.integration.memserver.planes import _answer, _hello, _request, _send, _ticket

CHUNK = 1 << 20            # bytes of a chunk (int64)
CHUNKS = 24                # chunks of the round: 24 MiB of sums a party is owed
WORDS = CHUNKS * CHUNK     # the count words, after the chunks


def _reduce(sock: socket.socket, req_id: int, c: int, parties: int, value: int, timeout: float = 60.0) -> None:
    """Party ``value`` pushes chunk ``c`` (its numbers are its own: one client id for all)."""
    arg0, arg1 = ChunkRound(WORDS + 8 * c, parties, 0).args()
    _send(sock, req_id, Op.REDUCE, 1, c * CHUNK, CHUNK, int(DType.INT64), arg0,
          np.full(CHUNK // 8, value, np.int64).tobytes(), seq=1000 * value + 2 * req_id, arg1=arg1,
          alpha=timeout)


def test_a_party_that_stopped_reading_does_not_hold_up_the_one_completing_the_rounds(plane):
    arena, tcp, _ = plane
    before = _native.parked()          # sums parked in this process by others (none, unless a test leaked some)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connecting: a small window
    stalled.connect(("127.0.0.1", tcp.port))
    with stalled, socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        _hello(stalled, _ticket([1]))
        _hello(sock, _ticket([1]))
        for c in range(CHUNKS):            # the stalled party pushes everything, then reads nothing
            _reduce(stalled, 10 + c, c, 2, 1)
        # every push of it taken (its sum parked) before the rounds complete: a frame the
        # server has not read yet waits behind the answers it cannot send (backpressure,
        # as for any client that stops reading); this test is about the other party
        wait_until(lambda: _native.parked() == before + CHUNKS, "the stalled party's pushes parked")
        sock.settimeout(20.0)              # far below the plane's frame timeout (60 s)
        sums = {}
        for c in range(CHUNKS):
            _reduce(sock, 10 + c, c, 2, 2)
            while c not in sums or len(sums) < c + 1:
                status, kind, req_id, body = _answer(sock)
                assert status == Status.OK
                if kind == wire.FINAL:
                    sums[req_id - 10] = body
        assert len(sums) == CHUNKS
        for body in sums.values():
            np.testing.assert_array_equal(np.frombuffer(body, np.int64), np.full(CHUNK // 8, 3))
        assert _request(sock, 99, Op.PING)[0] == Status.OK


def test_a_parked_sum_whose_round_never_completes_is_a_timeout(plane):
    arena, tcp, _ = plane
    before = _native.parked()
    with socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        _hello(sock, _ticket([1]))
        sock.settimeout(20.0)
        _reduce(sock, 5, 0, 2, 1, timeout=0.3)     # the other party never comes
        answers = [_answer(sock) for _ in range(2)]
        assert [(a[0], a[1], a[2]) for a in answers] == [(Status.OK, wire.PUSHED, 5),
                                                          (Status.TIMEOUT, wire.FINAL, 5)]
        assert b"not every party came" in answers[1][3]
        assert _native.parked() == before                   # nothing left behind
        assert _request(sock, 99, Op.PING)[0] == Status.OK


def test_a_parked_sum_whose_extent_is_released_is_answered_at_once(plane):
    arena, tcp, _ = plane
    with socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        _hello(sock, _ticket([1]))
        sock.settimeout(20.0)                      # the sum's own deadline is 60 s
        _reduce(sock, 5, 0, 2, 1)                  # parked: the other party has not come
        assert _answer(sock)[:3] == (Status.OK, wire.PUSHED, 5)
        assert arena.release(1)
        status, kind, req_id, body = _answer(sock)
        assert (status, kind, req_id) == (Status.EXTENT_NOT_FOUND, wire.FINAL, 5)
        assert _request(sock, 99, Op.PING)[0] == Status.OK
