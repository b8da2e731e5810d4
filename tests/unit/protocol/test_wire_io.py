"""The socket loops of smb_protocol/wire.py on non-blocking sockets (the memory server's
tcp plane uses them so): one syscall while bytes or room are there, a poll bounded by
the deadline (reads) or the stall limit (sends) when not."""
from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from smb_protocol import wire


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(0.0)
    yield a, b
    a.close()
    b.close()


def test_a_read_waits_for_bytes_that_trickle_in(pair):
    a, b = pair
    sent = bytes(range(200))

    def trickle():
        for i in range(0, len(sent), 50):
            b.sendall(sent[i:i + 50])
            time.sleep(0.01)
    t = threading.Thread(target=trickle)
    t.start()
    head, rest = bytearray(72), bytearray(128)
    wire.recv_into_all(a, [memoryview(head), memoryview(rest)], deadline=time.monotonic() + 30)
    t.join()
    assert bytes(head + rest) == sent


def test_a_read_past_its_deadline_times_out(pair):
    a, b = pair
    b.sendall(b"x" * 10)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        wire.recv_into_all(a, [memoryview(bytearray(20))], deadline=start + 0.2)
    assert time.monotonic() - start >= 0.2


def test_a_read_of_a_closed_peer_says_so(pair):
    a, b = pair
    b.close()
    with pytest.raises(wire.ServerUnavailable):
        wire.recv_into_all(a, [memoryview(bytearray(8))], deadline=time.monotonic() + 5)


def test_a_send_into_a_full_buffer_waits_for_room(pair):
    a, b = pair
    big = memoryview(bytearray(8 << 20))
    got = bytearray()

    def drain():
        while len(got) < len(big):
            got.extend(b.recv(1 << 20))
    t = threading.Thread(target=drain)
    t.start()
    wire.sendmsg_all(a, [b"head", big[4:]], stall=30)
    t.join()
    assert len(got) == len(big)


def test_a_send_stalled_longer_than_its_limit_times_out(pair):
    a, _ = pair
    with pytest.raises(TimeoutError):
        wire.sendmsg_all(a, [memoryview(bytearray(32 << 20))], stall=0.2)


def test_a_blocking_socket_keeps_its_own_timeout():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.2)
        with pytest.raises(TimeoutError):
            wire.recv_into_all(a, [memoryview(bytearray(8))])
        assert a.gettimeout() == 0.2


class _Counting(socket.socket):
    """A socket that counts its receives."""

    receives = 0

    def recvmsg_into(self, *args, **kwargs):
        self.receives += 1
        return super().recvmsg_into(*args, **kwargs)

    def recv_into(self, *args, **kwargs):
        self.receives += 1
        return super().recv_into(*args, **kwargs)


@pytest.fixture
def tcp_pair():
    """(reader, writer): a loopback TCP connection, the reader counting its receives."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        reader = _Counting(socket.AF_INET, socket.SOCK_STREAM)
        reader.connect(srv.getsockname())
        writer = srv.accept()[0]
    yield reader, writer
    reader.close()
    writer.close()


def _send_in_pieces(writer: socket.socket, data: bytes, pieces: int, close: bool = False) -> threading.Thread:
    def run():
        step = len(data) // pieces
        for i in range(0, len(data), step):
            writer.sendall(data[i:i + step])
            time.sleep(0.005)   # pacing only: the pieces arrive apart
        if close:
            writer.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("timeout", [None, 0.0, 30.0], ids=["blocking", "non-blocking", "timeout"])
def test_a_large_read_wakes_once_for_its_bytes(tcp_pair, timeout):
    """A payload that comes in eight pieces is read with a few receives, not one a
    piece: the socket's low-water mark is what is still to come, so the kernel wakes the
    reader when it is all there (or, early, when the receive window runs short); the
    mark is one byte again afterwards (a header must wake the reader however small)."""
    reader, writer = tcp_pair
    reader.settimeout(timeout)
    data = bytes(range(256)) * 1024   # 256 KiB
    t = _send_in_pieces(writer, data, 8)
    got = bytearray(len(data))
    wire.recv_into_all(reader, [memoryview(got)], deadline=time.monotonic() + 30 if timeout == 0.0 else None)
    t.join()
    assert got == data
    assert reader.receives <= 4
    assert reader.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


@pytest.mark.parametrize("timeout", [None, 0.0], ids=["blocking", "non-blocking"])
def test_a_large_read_of_a_peer_that_ends_short_says_so(tcp_pair, timeout):
    """The low-water mark does not hold a read whose peer ended before the payload: it
    fails at once, and the mark is one byte again."""
    reader, writer = tcp_pair
    reader.settimeout(timeout)
    t = _send_in_pieces(writer, b"y" * (100 << 10), 4, close=True)
    start = time.monotonic()
    with pytest.raises(wire.ServerUnavailable):
        wire.recv_into_all(reader, [memoryview(bytearray(256 << 10))], deadline=time.monotonic() + 30)
    t.join()
    assert time.monotonic() - start < 10
    assert reader.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


@pytest.mark.parametrize("timeout", [None, 0.0, 30.0], ids=["blocking", "non-blocking", "timeout"])
def test_a_large_read_whose_first_part_is_there_gets_the_rest(tcp_pair, timeout):
    """Part of the payload is in the socket when the read begins, the rest comes later:
    the read ends with all of it. (A blocking receive that took the first part and then
    slept was never woken: the kernel wakes a sleeper once the bytes not yet taken reach
    the low-water mark, and the rest was fewer.)"""
    reader, writer = tcp_pair
    reader.settimeout(timeout)
    data = bytes(range(256)) * 1024
    writer.sendall(data[:64 << 10])
    assert select.select([reader], [], [], 10)[0]     # the first part is there
    done = threading.Event()

    def read():
        wire.recv_into_all(reader, [memoryview(got)], deadline=time.monotonic() + 30 if timeout == 0.0 else None)
        done.set()
    got = bytearray(len(data))
    t = threading.Thread(target=read, daemon=True)
    t.start()
    rest = _send_in_pieces(writer, data[64 << 10:], 4)
    rest.join()
    finished = done.wait(10)
    if not finished:
        reader.shutdown(socket.SHUT_RDWR)   # let the stuck thread go
    assert finished and got == data


def test_a_small_read_sets_no_low_water_mark(tcp_pair):
    reader, writer = tcp_pair
    writer.sendall(b"z" * 1000)
    got = bytearray(1000)
    wire.recv_into_all(reader, [memoryview(got)])
    assert got == b"z" * 1000 and reader.receives == 1
    assert reader.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["blocking", "timeout"])
def test_a_small_read_in_pieces_is_whole_and_a_peer_ending_short_fails_it(tcp_pair, timeout):
    """A header's bytes that come in pieces end in one read; a peer that ends before
    them fails the read at once, on a blocking socket and on one with a timeout."""
    reader, writer = tcp_pair
    reader.settimeout(timeout)
    data = bytes(range(16)) * 4
    t = _send_in_pieces(writer, data, 4)
    got = bytearray(len(data))
    wire.recv_into_all(reader, [memoryview(got)])
    t.join()
    assert got == data
    writer.sendall(b"x" * 10)
    writer.close()
    with pytest.raises(wire.ServerUnavailable):
        wire.recv_exact(reader, 16)
