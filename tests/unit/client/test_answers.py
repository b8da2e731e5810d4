"""The native reader of a collective stream's answers (``smb_client/transports/answers.c``)
on a real loopback TCP connection: what it takes whole, what it leaves to Python, and
how it ends."""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from smb_client.transports._answers import Answers
from smb_protocol import wire


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair: (the reader's end, the server's end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def _answer(req_id: int, length: int, status: int = 0, kind: int = wire.FINAL) -> bytes:
    return wire.pack_response(status, req_id, length, kind)


def test_a_pushed_answer_is_taken_whole_with_its_word(pair):
    mine, peer = pair
    answers = Answers(mine.fileno())
    peer.sendall(_answer(7, 8, kind=wire.PUSHED) + (3).to_bytes(8, "little") + _answer(8, 0, kind=wire.PUSHED))
    for req_id in (7, 8):
        header, taken = answers.receive()
        assert taken and wire.unpack_answer(header) == (0, wire.PUSHED, req_id, 8 if req_id == 7 else 0)
    answers.close()


def test_a_sum_of_the_length_due_goes_into_the_registered_buffers_in_pieces(pair):
    """Three buffers, 3 MiB in all (above the low-water mark's cap), sent in uneven pieces
    with pauses: every byte lands in order, and the registration is dropped."""
    mine, peer = pair
    answers = Answers(mine.fileno())
    parts = [np.zeros(n, np.uint8) for n in (100, 3 << 20, 7)]
    answers.expect(5, [memoryview(p) for p in parts])
    assert answers.expected() == 1
    want = np.random.default_rng(1).integers(0, 256, sum(p.size for p in parts), dtype=np.uint8)
    data = _answer(5, want.size) + want.tobytes()

    def send() -> None:
        for start in range(0, len(data), 700_001):
            peer.sendall(data[start:start + 700_001])
            time.sleep(0.02)
    sender = threading.Thread(target=send)
    sender.start()
    header, taken = answers.receive()
    sender.join()
    assert taken and wire.unpack_answer(header)[2:] == (5, want.size)
    assert np.array_equal(np.concatenate(parts), want)
    assert answers.expected() == 0
    assert mine.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1   # reset after the payload


@pytest.mark.parametrize("case", ["wrong length", "error", "not registered", "forgotten", "bad magic"])
def test_other_answers_leave_their_body_to_the_caller(pair, case):
    mine, peer = pair
    answers = Answers(mine.fileno())
    into = np.zeros(16, np.uint8)
    answers.expect(9, [memoryview(into)])
    req_id, length, status = 9, 16, 0
    if case == "wrong length":
        length = 12
    elif case == "error":
        status = 4
    elif case == "not registered":
        req_id = 10
    elif case == "forgotten":
        assert answers.forget(9) and not answers.forget(9)
    header = _answer(req_id, length, status)
    if case == "bad magic":
        header = b"XX" + header[2:]
    peer.sendall(header + bytes(range(1, length + 1)))
    got, taken = answers.receive()
    assert got == header and not taken
    assert mine.recv(length, socket.MSG_WAITALL) == bytes(range(1, length + 1))   # still there to read
    assert not into.any()
    answers.close()


def test_a_peer_that_closes_mid_sum_is_a_connection_error_and_drops_the_buffers(pair):
    mine, peer = pair
    answers = Answers(mine.fileno())
    answers.expect(3, [memoryview(np.zeros(1 << 20, np.uint8))])
    peer.sendall(_answer(3, 1 << 20) + bytes(1000))
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError, match="closed by peer"):
        answers.receive()
    assert answers.expected() == 0


def test_a_shutdown_from_another_thread_ends_a_waiting_receive(pair):
    mine, _ = pair
    answers = Answers(mine.fileno())
    answers.expect(1, [memoryview(np.zeros(1 << 20, np.uint8))])
    with ThreadPoolExecutor(1) as reader:
        ended = reader.submit(answers.receive)
        time.sleep(0.1)          # let it block (nothing is sent; ending it is the point)
        mine.shutdown(socket.SHUT_RDWR)
        assert isinstance(ended.exception(10), OSError)
    answers.forget_all()
    assert answers.expected() == 0


def test_the_reader_keeps_reading_its_connection_after_the_descriptor_is_reused(pair):
    """The connection's socket object is closed and its descriptor number handed to a new
    connection: the reader still reads the old connection, never the new one."""
    mine, peer = pair
    answers = Answers(mine.fileno())
    number = mine.fileno()
    mine.close()
    with socket.socket() as other:
        assert other.fileno() == number     # the number is reused at once
        other.setblocking(False)
        peer.sendall(_answer(4, 0, kind=wire.PUSHED))
        header, taken = answers.receive()
        assert taken and wire.unpack_answer(header)[2] == 4
    answers.close()
    with pytest.raises(OSError) as info:
        answers.receive()
    assert info.value.errno == 9      # EBADF: closed


def test_registered_buffers_outlive_their_callers_references(pair):
    """The reader holds the buffers it was given: the caller may drop its own references
    (an abandoned round) and the sum still lands in live memory."""
    mine, peer = pair
    answers = Answers(mine.fileno())
    array = np.zeros(1 << 16, np.uint8)
    view = memoryview(array)
    answers.expect(2, [view])
    del array, view
    peer.sendall(_answer(2, 1 << 16) + os.urandom(1 << 16))
    assert answers.receive()[1]
    answers.close()


def test_a_read_only_buffer_is_refused(pair):
    mine, _ = pair
    answers = Answers(mine.fileno())
    with pytest.raises(BufferError):
        answers.expect(1, [memoryview(b"read only")])
    assert answers.expected() == 0
    answers.close()
