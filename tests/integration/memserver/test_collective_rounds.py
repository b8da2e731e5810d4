"""A collective's chunk requests at the wire: the memory server knows each chunk's round
and refuses a push or pull that does not fit it (RoundMismatch), a replayed one, and one
through a read-only ticket; nothing is added into another round's sum, and the
connection carries on. Raw frames against a real tcp plane and arena in this process.
"""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from smb_protocol import wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import Status
from smb_protocol.rounds import ChunkRound, count_word
from smb_protocol.wire import Op
from tests.integration.memserver.planes import _answer, _hello, _request, _send, _ticket

N = 512                    # int64 elements of the chunk
CHUNK = N * 8
WORD = 2 * CHUNK           # the count word of slot 0, after both slots


def _count(arena) -> int:
    return struct.unpack("<q", bytes(arena.get(1).data[WORD:WORD + 8]))[0]


def _chunk(arena) -> np.ndarray:
    return np.frombuffer(bytes(arena.get(1).data[:CHUNK]), np.int64)


def _push(sock, req_id: int, ref: ChunkRound, value: int, seq: int, op: Op = Op.PUSH) -> None:
    arg0, arg1 = ref.args()
    _send(sock, req_id, op, 1, 0, CHUNK, int(DType.INT64), arg0, np.full(N, value, np.int64).tobytes(),
          seq=seq, arg1=arg1, alpha=5.0)


def _pushed(sock, req_id: int, ref: ChunkRound, value: int, seq: int) -> None:
    """A push the server takes (answered OK)."""
    _push(sock, req_id, ref, value, seq)
    assert _answer(sock)[0] == Status.OK


def _pull(sock, req_id: int, ref: ChunkRound, seq: int) -> tuple[int, bytes]:
    arg0, arg1 = ref.args()
    return _request(sock, req_id, Op.PULL, 1, 0, CHUNK, 0, arg0, seq=seq, arg1=arg1, alpha=5.0)


@pytest.fixture
def conn(plane):
    arena, tcp, _ = plane
    with socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        _hello(sock, _ticket([1]))
        yield arena, sock


def _alive(sock) -> None:
    assert _request(sock, 99, Op.PING)[0] == Status.OK


def _left(arena, sock, value: int, count: int) -> None:
    """The chunk holds ``value`` in every element, its count word is ``count``, and the
    connection carries on."""
    np.testing.assert_array_equal(_chunk(arena), np.full(N, value))
    assert _count(arena) == count
    _alive(sock)


def test_a_push_of_a_round_the_chunk_is_past_is_refused_and_adds_nothing(conn):
    arena, sock = conn
    first = ChunkRound(WORD, 1, 0)
    _pushed(sock, 2, first, 5, seq=16)
    assert _pull(sock, 3, first, seq=32)[0] == Status.OK
    _pushed(sock, 4, ChunkRound(WORD, 1, 2), 7, seq=48)          # round 2 takes slot 0
    _push(sock, 5, first, 1000, seq=64)                          # a party still at round 0
    status, _, req_id, body = _answer(sock)
    assert (status, req_id) == (Status.ROUND_MISMATCH, 5)
    assert b"behind the others" in body
    _left(arena, sock, 7, count_word(2, 1))


def test_a_replayed_push_applies_once_and_a_copy_with_a_new_number_is_refused(conn):
    arena, sock = conn
    ref = ChunkRound(WORD, 1, 0)
    _push(sock, 2, ref, 5, seq=16)
    first = _answer(sock)
    _push(sock, 3, ref, 5, seq=16)                               # the same request again
    again = _answer(sock)
    assert first[0] == again[0] == Status.OK and first[3] == again[3]
    _push(sock, 4, ref, 5, seq=32)                               # replayed under a new number
    status, _, _, body = _answer(sock)
    assert status == Status.ROUND_MISMATCH and b"already has all its pushes" in body
    _left(arena, sock, 5, count_word(0, 1))


def test_a_reduce_of_a_wrong_round_gets_one_error_answer_and_no_sum(conn):
    arena, sock = conn
    ref = ChunkRound(WORD, 2, 0)
    _push(sock, 2, ref, 3, seq=16, op=Op.REDUCE)
    status, kind, _, _ = _answer(sock)
    assert (status, kind) == (Status.OK, wire.PUSHED)
    _push(sock, 3, ChunkRound(WORD, 2, 0, root=True), 9, seq=32, op=Op.REDUCE)   # no root in a reduce
    status, kind, req_id, _ = _answer(sock)
    assert (status, kind, req_id) == (Status.ROUND_MISMATCH, wire.FINAL, 3)
    _push(sock, 4, ref, 4, seq=48, op=Op.REDUCE)                 # the second party: the round completes
    answers = [_answer(sock) for _ in range(3)]                  # its PUSHED, then both sums
    assert sorted((a[2], a[1]) for a in answers) == [(2, wire.FINAL), (4, wire.FINAL), (4, wire.PUSHED)]
    for a in answers:
        if a[1] == wire.FINAL:
            np.testing.assert_array_equal(np.frombuffer(a[3], np.int64), np.full(N, 7))
    _alive(sock)                                                 # and no answer to request 3 came after its error
    assert _count(arena) == ref.end


def test_a_pull_of_a_round_that_is_gone_is_refused(conn):
    arena, sock = conn
    for r in (0, 2):
        ref = ChunkRound(WORD, 1, r)
        _pushed(sock, 2, ref, r + 1, seq=16 * (r + 1))
        if r == 0:
            assert _pull(sock, 3, ref, seq=24)[0] == Status.OK
    status, body = _pull(sock, 4, ChunkRound(WORD, 1, 0), seq=80)
    assert status == Status.ROUND_MISMATCH and b"is gone" in body
    _alive(sock)


def test_a_repeated_pull_after_a_later_round_overwrote_its_sum_is_refused(conn):
    arena, sock = conn
    ref = ChunkRound(WORD, 1, 0)
    _pushed(sock, 2, ref, 5, seq=16)
    status, body = _pull(sock, 3, ref, seq=32)
    assert status == Status.OK and np.frombuffer(body, np.int64)[0] == 5
    assert _pull(sock, 4, ref, seq=32) == (status, body)         # a repeat while the sum is there
    _pushed(sock, 5, ChunkRound(WORD, 1, 2), 8, seq=48)
    status, body = _pull(sock, 6, ref, seq=32)                   # the repeat would now read round 2's bytes
    assert status == Status.ROUND_MISMATCH and b"overwritten" in body


def test_chunk_requests_through_a_read_only_ticket_are_refused(plane):
    arena, tcp, _ = plane
    with socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        _hello(sock, _ticket([1], "ro"))
        ref = ChunkRound(WORD, 1, 0)
        for op in (Op.PUSH, Op.REDUCE):
            _push(sock, 2, ref, 5, seq=16, op=op)
            assert _answer(sock)[0] == Status.READ_ONLY
        assert _pull(sock, 3, ref, seq=32)[0] == Status.READ_ONLY
        _left(arena, sock, 0, 0)


def test_chunk_request_fields_that_name_no_round_are_refused(conn):
    arena, sock = conn
    _send(sock, 2, Op.PUSH, 1, 0, CHUNK, int(DType.INT64), WORD, bytes(CHUNK), seq=16, arg1=-1, alpha=5.0)
    status, _, _, body = _answer(sock)
    assert status == Status.INVALID_ARGUMENT and b"negative" in body
    _send(sock, 3, Op.PUSH, 1, 0, CHUNK, int(DType.INT64), WORD, bytes(CHUNK), seq=32, alpha=5.0)   # 0 parties
    status, _, _, body = _answer(sock)
    assert status == Status.INVALID_ARGUMENT and b"parties" in body
    assert _count(arena) == 0
    _alive(sock)
