"""The tcp transport's options and its dead-peer detection settings (no server needed)."""
from __future__ import annotations

import socket

import pytest

from smb_client.transports import tcp
from smb_protocol import errors, wire
from smb_protocol.addressing import parse_endpoint


def test_dead_peer_timeout_sets_keepalive_and_user_timeout():
    with socket.socket() as s:
        wire.set_dead_peer_timeout(s, 2.5)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == wire.KEEPALIVE_IDLE
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 2


@pytest.mark.parametrize("option", ["io_timeout", "dead_peer_timeout"])
@pytest.mark.parametrize("value", [0, -1.0])
def test_non_positive_timeouts_are_refused(option, value):
    with pytest.raises(errors.InvalidArgument, match=option):
        tcp.TcpSession(parse_endpoint("tcp://127.0.0.1:1"), {option: value})


def test_unreachable_server_is_a_typed_error():
    with socket.socket() as s:           # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    session = tcp.TcpSession(parse_endpoint(f"tcp://127.0.0.1:{port}"), {})
    with pytest.raises(errors.ServerUnavailable, match=f"127.0.0.1:{port}"):
        session.read_into("ticket", 1, 0, [memoryview(bytearray(8))])
    session.close()
