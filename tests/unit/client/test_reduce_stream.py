"""A collective's pipelined stream (``ReduceStream``) against a scripted server on a real
loopback socket: answers taken by the native reader finish their requests, the others
(errors, a sum of the wrong length, an answer to nothing in flight) are handled in
Python, and nothing stays registered with the reader."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import pytest

from smb_client.transports.stream import ReduceStream, Reduction
from smb_protocol import errors, wire
from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.dtypes import DType
from smb_protocol.framing import ClientFrames
from smb_protocol.rounds import ChunkRound

N = 4096      # bytes of each request's chunk


class Conn:
    """What a stream needs of a connection, over a plain socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.client_id = 7
        self.frames = ClientFrames("scripted")
        self.dead_peer_timeout = 5.0

    def close(self) -> None:
        self.sock.close()


Script = Callable[[socket.socket, int, bytes], None]   # (server's socket, req_id, payload)


@pytest.fixture
def served() -> Iterator[Callable[[Script], ReduceStream]]:
    """``served(script)``: a stream to a server that answers each REDUCE with ``script``
    (a HELLO is answered OK)."""
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []
    streams: list[ReduceStream] = []

    def serve(script: Script) -> None:
        sock, _ = listener.accept()
        with sock:
            try:
                while True:
                    head = wire.recv_exact(sock, wire.REQUEST.size)
                    fields = wire.REQUEST.unpack(head)
                    op, req_id, length = fields[1], fields[3], fields[6]
                    payload = bytes(wire.recv_exact(sock, length)) if length else b""
                    if op == wire.Op.HELLO:
                        sock.sendall(wire.pack_response(0, req_id, 0))
                    else:
                        script(sock, req_id, payload)
            except (OSError, errors.SMBError):
                return

    def make(script: Script) -> ReduceStream:
        t = threading.Thread(target=serve, args=(script,), daemon=True)
        t.start()
        threads.append(t)
        stream = ReduceStream(lambda: Conn(socket.create_connection(listener.getsockname())), "scripted")
        streams.append(stream)
        return stream
    yield make
    for stream in streams:
        stream.close()
    listener.close()
    for t in threads:
        t.join(10)


def _send(stream: ReduceStream, data: np.ndarray, seq: int) -> tuple[Future[errors.SMBError | None], list[int]]:
    """Send ``data`` as one REDUCE; (its outcome, the count of its pushed() calls)."""
    done: Future[errors.SMBError | None] = Future()
    pushed: list[int] = []
    view = memoryview(data).cast("B")
    stream.send("ticket", Reduction(1, 0, [view], ChunkTypes(DType.INT64), ChunkRound(0, 2, 0), 5.0, seq,
                                    pushed=lambda: pushed.append(1), done=done.set_result))
    return done, pushed


def _doubled(sock: socket.socket, req_id: int, payload: bytes) -> None:
    sock.sendall(wire.pack_response(0, req_id, 8, wire.PUSHED) + bytes(8))
    sock.sendall(wire.pack_response(0, req_id, len(payload)) + bytes(2 * b for b in payload))


def test_pushed_words_and_sums_finish_their_requests(served):
    stream = served(_doubled)
    sent = [np.full(N, k + 1, np.uint8) for k in range(5)]
    outcomes = [_send(stream, data, k + 1) for k, data in enumerate(sent)]
    for k, (done, pushed) in enumerate(outcomes):
        assert done.result(10) is None and pushed == [1]
        assert (sent[k] == 2 * (k + 1)).all()
    assert stream._link is not None and stream._link.answers.expected() == 0


def test_an_error_answer_fails_its_request_alone_and_leaves_its_buffer(served):
    def script(sock: socket.socket, req_id: int, payload: bytes) -> None:
        if payload[0] == 1:
            message = b"no such extent"
            sock.sendall(wire.pack_response(errors.error_status(errors.ExtentNotFound("")), req_id, len(message))
                         + message)
        else:
            _doubled(sock, req_id, payload)
    stream = served(script)
    first, second = np.full(N, 1, np.uint8), np.full(N, 3, np.uint8)
    failed, _ = _send(stream, first, 1)
    err = failed.result(10)
    assert isinstance(err, errors.ExtentNotFound) and "no such extent" in str(err)
    assert (first == 1).all()
    ok, _ = _send(stream, second, 2)             # the same connection goes on
    assert ok.result(10) is None and (second == 6).all()
    assert stream._link is not None and stream._link.answers.expected() == 0


@pytest.mark.parametrize("bad", ["a sum of the wrong length", "an answer to nothing in flight"])
def test_a_bad_answer_fails_what_is_in_flight_with_a_protocol_error(served, bad):
    def script(sock: socket.socket, req_id: int, payload: bytes) -> None:
        if bad == "a sum of the wrong length":
            sock.sendall(wire.pack_response(0, req_id, len(payload) - 4) + payload[:-4])
        else:
            sock.sendall(wire.pack_response(0, req_id + 1000, 0))
    stream = served(script)
    data = np.full(N, 5, np.uint8)
    done, _ = _send(stream, data, 1)
    err = done.result(10)
    assert isinstance(err, errors.ProtocolError)
    assert ("were due" if bad == "a sum of the wrong length" else "not in flight") in str(err)
    assert (data == 5).all()
    assert stream._link is None and stream.in_flight() == 0      # the connection is given up
