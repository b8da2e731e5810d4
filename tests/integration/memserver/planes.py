"""A memory server's tcp plane in this process, over a real arena and real sockets, and
the raw frames the wire-level tests send it."""
from __future__ import annotations

import socket

import pytest

from smb_client.transports.tcp import TcpSession
from smb_protocol import requests, tickets, wire
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import Status
from smb_protocol.wire import Op
from smb_server.memserver.arena import Arena
from smb_server.memserver.node import Node
from smb_server.memserver.stats import PlaneStats
from smb_server.memserver.tcp_plane import TcpPlane

SECRET = b"e" * 32
UID = "region-once"
MiB = 1 << 20
CLIENT = 0x5EED


def _ticket(extent_ids: list[int], mode: str = "rw") -> str:
    return tickets.sign(SECRET, UID, extent_ids, mode, ttl=600.0)[0]


@pytest.fixture
def plane():
    """(arena, tcp plane, stats) with extent 1 of 32 MiB reserved for region ``UID``."""
    arena = Arena(128 * MiB)
    stats = PlaneStats()
    tcp = TcpPlane(Node(arena, SECRET), "127.0.0.1", 0, stats.for_transport("tcp"))
    arena.reserve(1, UID, 32 * MiB)
    yield arena, tcp, stats
    tcp.close()
    arena.close()


def _send(sock: socket.socket, req_id: int, op: int, extent_id: int = 0, offset: int = 0,
          length: int = 0, dtype: int = 0, arg0: int = 0, payload: bytes = b"", seq: int = 0,
          arg1: int = 0, alpha: float = 0.0) -> None:
    wire.sendmsg_all(sock, [wire.pack_request(op, req_id, extent_id, offset, length, dtype, arg0, arg1, alpha,
                                              client=CLIENT if seq else 0, seq=seq), payload])


def _answer(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(status, kind, req_id, body) of the next answer."""
    status, kind, req_id, n = wire.unpack_answer(wire.recv_exact(sock, wire.RESPONSE.size))
    return status, kind, req_id, bytes(wire.recv_exact(sock, n))


def _request(sock: socket.socket, req_id: int, op: int, extent_id: int = 0, offset: int = 0,
             length: int = 0, dtype: int = 0, arg0: int = 0, payload: bytes = b"",
             seq: int = 0, arg1: int = 0, alpha: float = 0.0) -> tuple[int, bytes]:
    """Send one request and take its (only) answer: (status, body)."""
    _send(sock, req_id, op, extent_id, offset, length, dtype, arg0, payload, seq, arg1, alpha)
    status, _, got, body = _answer(sock)
    assert got == req_id
    return status, body


def _hello(sock: socket.socket, token: str) -> None:
    raw = token.encode()
    assert _request(sock, 1, Op.HELLO, length=len(raw), payload=raw)[0] == Status.OK


def _session(port: int) -> TcpSession:
    return TcpSession(parse_endpoint(f"tcp://127.0.0.1:{port}"), {"client_id": CLIENT, "connections": 1})


def typed(op: Op, extent_id: int = 0, offset: int = 0, length: int = 0, dtype: int = 0, arg0: int = 0,
          arg1: int = 0, alpha: float = 0.0, seq: int = 0, client: int = 0) -> requests.Request:
    """The typed request a frame of these raw fields decodes to (for tests that send
    what a client library would not: unknown conditions, odd lengths, NaN timeouts)."""
    return requests.from_frame(op, dtype, 0, extent_id, offset, length, arg0, arg1, alpha, client, seq)
