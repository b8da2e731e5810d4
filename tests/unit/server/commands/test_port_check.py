"""`smb up --port P`'s check that P is free: a port that only sockets in TIME_WAIT hold
(what `smb down` leaves for about a minute) is free, a listening one is not."""
from __future__ import annotations

import socket

import pytest

from smb_server.commands.local_cluster import LOOPBACK, ClusterError, check_port_free


def _time_wait_port() -> int:
    """A port whose listener is closed and whose one connection this side closed first,
    so that the connection's socket stays in TIME_WAIT on that port."""
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    peer = socket.create_connection((LOOPBACK, port))
    accepted, _ = listener.accept()
    listener.close()
    accepted.close()           # the active close: TIME_WAIT on (LOOPBACK, port)
    assert peer.recv(1) == b""
    peer.close()
    return port


def test_a_port_left_in_time_wait_is_free():
    port = _time_wait_port()
    with socket.socket() as plain:   # what a bind without SO_REUSEADDR meets
        with pytest.raises(OSError):
            plain.bind((LOOPBACK, port))
    check_port_free(port)


def test_a_listening_port_is_in_use():
    with socket.create_server((LOOPBACK, 0)) as listener:
        with pytest.raises(ClusterError, match="already in use"):
            check_port_free(listener.getsockname()[1])
