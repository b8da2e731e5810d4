"""The socket loops of smb_protocol/wire.py on non-blocking sockets (the memory server's
tcp plane uses them so): one syscall while bytes or room are there, a poll bounded by
the deadline (reads) or the stall limit (sends) when not."""
from __future__ import annotations

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
