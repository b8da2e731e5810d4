"""A tcp connection's REDUCEs served by the native loop (smb_server/memserver/native/serve.c,
tcp_native.py): once Python served one of a connection's REDUCEs of an extent, the next
ones never reach the engine, and they keep every rule the engine keeps: sums exact,
exactly once across connections (a retry of a natively served request is answered, not
applied again), refusals and waits that run out answered with typed errors on a
connection that stays usable, and a client that vanishes mid-payload leaves nothing
applied. Raw frames against a real tcp plane and arena in this process."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from smb_protocol import wire
from smb_protocol.chunk_types import ChunkTypes, narrow, widen
from smb_protocol.dtypes import STORAGE, DType, f32_to_bf16
from smb_protocol.errors import Status
from smb_protocol.requests import Reduce
from smb_protocol.rounds import ChunkRound, count_word
from smb_protocol.wire import Op
from smb_server.memserver import _native, kernels, tcp_sums
from smb_server.testing import wait_until
from tests.integration.memserver.planes import CLIENT, _answer, _hello, _request, _send, _ticket

CHUNK = 64 << 10                 # bytes of a chunk (int64)
WORDS = 2 * CHUNK                # the two slots' count words, after the slots
N = CHUNK // 8


def _reduce(sock: socket.socket, req_id: int, round_: int, parties: int, value: int, seq: int,
            timeout: float = 30.0, payload: bytes | None = None) -> None:
    """A REDUCE of ``value`` into the slot of ``round_`` (slots alternate)."""
    slot = round_ % 2
    arg0, arg1 = ChunkRound(WORDS + 8 * slot, parties, round_).args()
    body = np.full(N, value, np.int64).tobytes() if payload is None else payload
    _send(sock, req_id, Op.REDUCE, 1, slot * CHUNK, CHUNK, int(DType.INT64), arg0, body, seq=seq,
          arg1=arg1, alpha=timeout)


def _pushed_and_sum(sock: socket.socket, req_id: int) -> tuple[int, np.ndarray]:
    """The REDUCE's two answers: the count word its push found, and its sum."""
    status, kind, got, body = _answer(sock)
    assert (status, kind, got) == (Status.OK, wire.PUSHED, req_id), body
    old = int.from_bytes(body, "little", signed=True)
    status, kind, got, body = _answer(sock)
    assert (status, kind, got) == (Status.OK, wire.FINAL, req_id), body
    return old, np.frombuffer(body, np.int64)


@contextmanager
def _party(tcp) -> Iterator[socket.socket]:   # type: ignore[no-untyped-def]
    """A connection to the plane that presented its ticket for extent 1."""
    with socket.create_connection(("127.0.0.1", tcp.port)) as sock:
        sock.settimeout(20.0)
        _hello(sock, _ticket([1]))
        yield sock


@pytest.fixture
def counted(plane, monkeypatch):
    """(arena, plane, REDUCEs the engine saw): what the native loop served never gets there."""
    arena, tcp, _ = plane
    seen: list[int] = []
    handle = tcp.engine.handle

    def counting(peer, req):   # type: ignore[no-untyped-def]
        if isinstance(req, Reduce):
            seen.append(req.req_id)
        return handle(peer, req)
    monkeypatch.setattr(tcp.engine, "handle", counting)
    return arena, tcp, seen


def test_after_the_first_the_reduces_of_a_connection_are_served_natively(counted):
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        for r in range(12):
            _reduce(sock, 10 + r, r, 1, r + 1, seq=100 + 2 * r)
            old, got = _pushed_and_sum(sock, 10 + r)
            assert old == (0 if r < 2 else count_word(r - 2, 2))   # the slot's round before: ended
            np.testing.assert_array_equal(got, np.full(N, r + 1))
        assert seen == [10]                                           # only the first
        assert _request(sock, 99, Op.PING)[0] == Status.OK
    served = tcp.stats.snapshot()
    assert served["bytes_accumulated"] >= 12 * CHUNK and served["bytes_read"] >= 12 * CHUNK


def test_a_push_that_comes_in_pieces_wakes_the_loop_about_once(counted):
    """The loop sets the socket's low-water mark to the payload it waits for: a push
    whose 64 KiB come in eight paced pieces is waited for once or twice, not once a
    piece; its sum is right."""
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        _reduce(sock, 10, 0, 1, 1, seq=100)          # the Python way: registers the extent
        _pushed_and_sum(sock, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # each piece its own segment
        arg0, arg1 = ChunkRound(WORDS + 8, 1, 1).args()
        sock.sendall(wire.pack_request(Op.REDUCE, 11, 1, CHUNK, CHUNK, int(DType.INT64), arg0, arg1, 30.0,
                                       client=CLIENT, seq=102))
        body = np.full(N, 2, np.int64).tobytes()
        for i in range(0, CHUNK, CHUNK // 8):
            sock.sendall(body[i:i + CHUNK // 8])
            time.sleep(0.005)   # pacing only: the pieces arrive apart
        old, got = _pushed_and_sum(sock, 11)
        np.testing.assert_array_equal(got, np.full(N, 2))
        assert seen == [10]
        wait_until(lambda: tcp.stats.snapshot()["bytes_accumulated"] >= 2 * CHUNK, "the served push counted",
                   timeout=10)
    assert 1 <= tcp.stats.limits()["payload_waits"] <= 2


def _send_queue(local_port: int, remote_port: int) -> int:
    """Bytes queued to send on the loopback connection between these ports (the
    kernel's table, /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if (int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)) == (local_port, remote_port):
                return int(fields[4].split(":")[0], 16)
    return 0


def test_a_sum_for_a_full_socket_is_sent_by_its_connections_own_thread(counted, monkeypatch):
    """The push that completes a round cannot send another connection's sum while that
    connection's socket is full (its client is not reading): the sum goes to that
    connection's own thread, which sends it natively, waiting for room; Python never
    sees it (it sent every such sum before)."""
    arena, tcp, seen = counted
    by_python: list[object] = []
    real = tcp_sums.hand_back

    def counting(owner, node, pull, left):   # type: ignore[no-untyped-def]
        by_python.append(pull)
        return real(owner, node, pull, left)
    monkeypatch.setattr(tcp_sums, "hand_back", counting)
    reads = 16                                     # of 1 MiB: more than any socket buffer holds
    with _party(tcp) as a, socket.socket() as b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        b.connect(("127.0.0.1", tcp.port))
        b.settimeout(20.0)
        _hello(b, _ticket([1]))
        _reduce(a, 10, 0, 2, 1, seq=100)           # Python's: the extent registers on both
        _reduce(b, 10, 0, 2, 2, seq=200)
        for s in (a, b):
            _pushed_and_sum(s, 10)
        _reduce(b, 11, 1, 2, 5, seq=202)           # b's push, its sum parked
        assert _answer(b)[:3] == (Status.OK, wire.PUSHED, 11)
        for i in range(reads):
            _send(b, 20 + i, Op.READ, 1, 0, 1 << 20)
        port = b.getsockname()[1]
        queued = [-1]

        def stalled() -> bool:                     # the server's side of b stopped moving: full
            before, queued[0] = queued[0], _send_queue(tcp.port, port)
            return queued[0] > (1 << 20) and queued[0] == before
        wait_until(stalled, "b's socket full", timeout=20, pause=0.05)
        _reduce(a, 11, 1, 2, 7, seq=102)           # completes the round: a's thread cannot send b's sum
        _, got = _pushed_and_sum(a, 11)
        np.testing.assert_array_equal(got, np.full(N, 12))
        answers = _answers(b, reads + 1)           # b reads at last
        status, body = answers[11, wire.FINAL]
        assert status == Status.OK
        np.testing.assert_array_equal(np.frombuffer(body, np.int64), np.full(N, 12))
        assert all(answers[20 + i, wire.FINAL][0] == Status.OK for i in range(reads))
    assert by_python == []


def _answers(sock: socket.socket, n: int) -> dict[tuple[int, int], tuple[int, bytes]]:
    """The next ``n`` answers by (req_id, kind): (status, body)."""
    out = {}
    for _ in range(n):
        status, kind, req_id, body = _answer(sock)
        out[req_id, kind] = (status, body)
    return out


def test_a_retry_of_a_natively_served_reduce_is_answered_not_applied_again(counted):
    arena, tcp, seen = counted
    with _party(tcp) as a, _party(tcp) as b:
        _reduce(a, 10, 0, 2, 1, seq=100)            # Python's: the extent registers on both
        _reduce(b, 10, 0, 2, 2, seq=200)
        for s in (a, b):
            _pushed_and_sum(s, 10)
        seen.clear()
        _reduce(a, 11, 1, 2, 5, seq=102)            # native
        assert _answer(a)[:3] == (Status.OK, wire.PUSHED, 11)
        _reduce(b, 12, 1, 2, 5, seq=102)            # a's request again (the same client and number)
        status, kind, got, body = _answer(b)
        assert (status, kind, got) == (Status.OK, wire.PUSHED, 12)
        assert int.from_bytes(body, "little") == 0  # the word the first attempt found
        assert seen == [12]                         # a number seen before: the Python way
        _reduce(b, 13, 1, 2, 7, seq=202)            # b's own push completes the round
        on_b = _answers(b, 3)
        assert set(on_b) == {(13, wire.PUSHED), (13, wire.FINAL), (12, wire.FINAL)}
        sums = [on_b[13, wire.FINAL], on_b[12, wire.FINAL], _answer(a)[::3]]
        for status, body in sums:
            assert status == Status.OK
            np.testing.assert_array_equal(np.frombuffer(body, np.int64), np.full(N, 12))   # 5 once, not twice
        assert seen == [12]


def test_a_refused_push_is_answered_and_the_connection_goes_on(counted):
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        for r in range(4):
            _reduce(sock, 10 + r, r, 1, 1, seq=100 + 2 * r)
            _pushed_and_sum(sock, 10 + r)
        _reduce(sock, 20, 1, 1, 1, seq=300)         # round 1 again: this party is behind
        status, kind, got, body = _answer(sock)
        assert (status, got) == (Status.ROUND_MISMATCH, 20) and b"behind the others" in body
        assert seen == [10]
        _reduce(sock, 21, 4, 1, 3, seq=302)         # and goes on
        np.testing.assert_array_equal(_pushed_and_sum(sock, 21)[1], np.full(N, 3))


def test_a_push_whose_slot_stays_busy_is_a_timeout_and_nothing_is_applied(counted):
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        _reduce(sock, 10, 0, 2, 1, seq=100, timeout=0.5)   # the other party never comes
        assert _answer(sock)[:3] == (Status.OK, wire.PUSHED, 10)
        _reduce(sock, 11, 2, 2, 1, seq=102, timeout=0.3)   # slot 0 still holds round 0
        answers = _answers(sock, 2)
        assert set(answers) == {(10, wire.FINAL), (11, wire.FINAL)}
        for status, body in answers.values():
            assert status == Status.TIMEOUT and b"not every party came" in body
        assert seen == [10]
        word = int(np.frombuffer(arena.get(1).data[WORDS:WORDS + 8], np.int64)[0])
        assert word == count_word(0, 1)                      # round 2's push never went in


def test_a_client_gone_mid_payload_leaves_nothing_applied_and_its_retry_applies_once(counted):
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        _reduce(sock, 10, 0, 1, 1, seq=100)
        _pushed_and_sum(sock, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # each piece its own segment
        arg0, arg1 = ChunkRound(WORDS + 8, 1, 1).args()
        head = wire.pack_request(Op.REDUCE, 11, 1, CHUNK, CHUNK, int(DType.INT64), arg0, arg1, 30.0,
                                 client=0x5EED, seq=102)
        sock.sendall(head + np.full(N, 4, np.int64).tobytes()[:CHUNK // 2])   # half its payload, then gone
    with _party(tcp) as sock:
        _reduce(sock, 11, 1, 1, 4, seq=102)                 # the retry: its first attempt applied nothing
        old, got = _pushed_and_sum(sock, 11)
        assert old == 0
        np.testing.assert_array_equal(got, np.full(N, 4))


@pytest.mark.parametrize("wire_type, full", [(DType.BFLOAT16, False), (DType.FLOAT16, False),
                                             (DType.BFLOAT16, True)], ids=["bf16", "fp16", "bf16-full"])
def test_16_bit_pushes_are_summed_in_float32_and_answered_as_python_answers_them(counted, wire_type, full):
    arena, tcp, seen = counted
    types = ChunkTypes(DType.FLOAT32, wire_type, full)
    n = CHUNK // 4                                   # float32 elements of a slot
    rng = np.random.default_rng(7)
    with _party(tcp) as a, _party(tcp) as b:
        for r in range(3):                           # round 0 the Python way, then natively
            pushes = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
            wires = [np.empty(n, STORAGE[wire_type]) for _ in range(2)]
            for p, w in zip(pushes, wires, strict=True):
                narrow(p, wire_type, w)
            for i, (s, w) in enumerate(zip((a, b), wires, strict=True)):
                arg0, arg1 = ChunkRound(WORDS + 8 * (r % 2), 2, r).args()
                _send(s, 10 + r, Op.REDUCE, 1, (r % 2) * CHUNK, w.nbytes, types.code(), arg0, w.tobytes(),
                      seq=100 * (i + 1) + 2 * r, arg1=arg1, alpha=30.0)
            wide = []
            for w in wires:
                f = np.empty(n, np.float32)
                widen(w, wire_type, f)
                wide.append(f)
            total = wide[0] + wide[1]                # float32, rounded once below (or not: full)
            want = total.tobytes()
            if not full:
                out = np.empty(n, STORAGE[wire_type])
                narrow(total, wire_type, out)
                want = out.tobytes()
            for s in (a, b):
                on = _answers(s, 2)
                assert on[10 + r, wire.PUSHED][0] == Status.OK
                assert on[10 + r, wire.FINAL] == (Status.OK, want)
        assert seen == [10, 10]                      # each connection's first only


def test_a_push_waiting_for_its_slot_ends_when_the_plane_closes(counted):
    arena, tcp, seen = counted
    with _party(tcp) as sock:
        before = _native.parked()
        _reduce(sock, 10, 0, 2, 1, seq=100)                 # the other party never comes
        assert _answer(sock)[:3] == (Status.OK, wire.PUSHED, 10)
        _reduce(sock, 11, 2, 2, 1, seq=102, timeout=60.0)   # waits natively: slot 0 holds round 0
        wait_until(lambda: _native.parked() == before + 1, "round 0's sum parked")
        name = f"tcp-127.0.0.1:{sock.getsockname()[1]}"    # the connection's thread, in the loop
        served = [t for t in threading.enumerate() if t.name == name]
        assert len(served) == 1
        tcp.close()
        # its thread ends with the plane, not when the push's 60 s run out
        wait_until(lambda: not served[0].is_alive(), "the waiting connection's thread ended", timeout=15.0)
        assert seen == [10]


@pytest.mark.parametrize("dt", [DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16, DType.INT32,
                                DType.INT64], ids=lambda d: d.name.lower())
def test_every_element_type_is_summed_natively_as_the_kernels_sum_it(counted, dt):
    arena, tcp, seen = counted
    size = STORAGE[dt].itemsize
    n = CHUNK // size
    rng = np.random.default_rng(int(dt))
    with _party(tcp) as a, _party(tcp) as b:
        for r in range(3):
            if dt in (DType.INT32, DType.INT64):   # wrapping sums, exact
                info = np.iinfo(STORAGE[dt])
                pushes = [rng.integers(info.min, info.max, n, dtype=STORAGE[dt], endpoint=True) for _ in range(2)]
            else:
                pushes = [_floats(rng, n, dt) for _ in range(2)]
            want = np.zeros(n, STORAGE[dt])
            kernels.accumulate(want.data.cast("B"), pushes[0].data.cast("B"), dt)
            kernels.accumulate(want.data.cast("B"), pushes[1].data.cast("B"), dt)
            for i, (s, p) in enumerate(zip((a, b), pushes, strict=True)):
                arg0, arg1 = ChunkRound(WORDS + 8 * (r % 2), 2, r).args()
                _send(s, 10 + r, Op.REDUCE, 1, (r % 2) * CHUNK, p.nbytes, int(dt), arg0, p.tobytes(),
                      seq=100 * (i + 1) + 2 * r, arg1=arg1, alpha=30.0)
            for s in (a, b):
                on = _answers(s, 2)
                assert on[10 + r, wire.FINAL] == (Status.OK, want.tobytes())
        assert seen == [10, 10]


def _floats(rng: np.random.Generator, n: int, dt: DType) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(x)
    return x.astype(STORAGE[dt])
