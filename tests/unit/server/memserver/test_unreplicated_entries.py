"""A numbered mutation served the unreplicated way has its exactly-once entry finished
before the move that waits for it may go on: the move's copy hands the entries over
right after the bytes, and a retry of that request at the new place (a collective's
``REDUCE`` is sent again whole when its pull was refused by the move) must find it
answered, not apply it a second time.

The engine and its node (arena, exactly-once table, replication, waits) are the
server's own; the connection is a double of the engine's Peer. Each test holds the
request at the moment its entry is being finished and checks what a move's drain sees.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from smb_protocol import tickets
from smb_protocol.dtypes import DType
from smb_protocol.requests import FetchAdd, Push, Request
from smb_protocol.rounds import ChunkRound
from smb_protocol.wire import Op
from smb_server.memserver.arena import Arena
from smb_server.memserver.dedup import DedupTable
from smb_server.memserver.engine import Engine
from smb_server.memserver.node import Node
from tests.unit.server.memserver.peer_double import PeerDouble

SECRET = b"s" * 32
UID = "region-moved"
CHUNK = 4096
WORD = 2 * CHUNK
CLIENT, SEQ = 0x51, 32


@pytest.fixture
def node():
    arena = Arena(16 << 20)
    n = Node(arena, SECRET, dedup=DedupTable())
    arena.reserve(1, UID, 4 * CHUNK)
    yield n
    n.close()
    arena.close()


def _held_at_finish(node: Node, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the first finish of an entry wait: (entered, go on)."""
    entered, go_on = threading.Event(), threading.Event()
    finish: Callable = node.dedup._finish

    def held(entry, status, body):
        if not entered.is_set():
            entered.set()
            assert go_on.wait(10)
        finish(entry, status, body)
    monkeypatch.setattr(node.dedup, "_finish", held)
    return entered, go_on


def _drained_entries(node: Node, req: Request, conn: PeerDouble, monkeypatch) -> list[tuple[int, int]]:
    """Serve ``req`` while a move's drain of its extent runs; the (client, seq) of every
    entry the drained extent would hand over, read the moment the drain ended."""
    entered, go_on = _held_at_finish(node, monkeypatch)
    served: list[BaseException | bytes | None] = []
    t = threading.Thread(target=lambda: served.append(Engine(node).handle(conn, req)))
    t.start()
    assert entered.wait(10), "the request never finished its entry"
    seen: list[tuple[int, int]] = []
    drained = threading.Event()

    def drain() -> None:
        node.replication._drain_unreplicated(1, 10.0)
        seen.extend((client, seq) for client, seq, *_ in node.dedup.export(1))
        drained.set()
    d = threading.Thread(target=drain)
    d.start()
    drained.wait(0.3)   # without the entry counted, the drain would end here at once
    go_on.set()
    t.join(10)
    d.join(10)
    assert served, "the request did not end"
    return seen


def test_a_numbered_fetch_add_is_handed_over_once_a_drain_ends(node, monkeypatch):
    token = tickets.sign(SECRET, UID, [1], "rw", ttl=600.0)[0]
    req = FetchAdd(Op.FETCH_ADD, 7, 1, 0, 8, client=CLIENT, seq=SEQ, value=5)
    assert _drained_entries(node, req, PeerDouble(SECRET, token), monkeypatch) == [(CLIENT, SEQ)]


def test_a_collective_push_is_handed_over_once_a_drain_ends(node, monkeypatch):
    token = tickets.sign(SECRET, UID, [1], "rw", ttl=600.0)[0]
    chunk = np.arange(CHUNK // 8, dtype=np.int64).tobytes()
    req = Push(Op.PUSH, 7, 1, 0, CHUNK, client=CLIENT, seq=SEQ, dtype=int(DType.INT64),
               ref=ChunkRound(WORD, 2, 0), timeout=5.0)
    assert _drained_entries(node, req, PeerDouble(SECRET, token, chunk), monkeypatch) == [(CLIENT, SEQ)]
