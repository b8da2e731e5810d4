"""The Python side of a tcp connection's native loop (``native/serve.c``, module docstring
there): run it, answer what it gives up, and count what it served.

The loop reads the connection's frames and serves the REDUCEs it can without the
interpreter; it returns when a frame is Python's (its header left in the connection's
buffer), when a tick passes (so Python looks at the plane's closing and adds the loop's
counters to the statistics), or with an event: a push the round rules refused, a push
whose slot's previous round never ended, a push whose extent went or began moving, or
a sum it parked that must be served the Python way (handed back: its deadline passed,
its extent went, its pull's number was seen before; a sum another connection's thread
could not send at once, the socket being full, the connection's own loop sends itself,
waiting for room). Those are answered here, as the engine answers them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from smb_protocol import requests, rounds
from smb_protocol.errors import ExtentNotFound, SMBError
from smb_protocol.tickets import Ticket
from smb_protocol.wire import Op

from . import _native, collective_ops, tcp_sums
from .stats import PlaneStats

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger(__name__)

TICK = 0.2   # seconds the native loop serves before Python looks in (statistics, closing)


class Connection(tcp_sums.Owner, Protocol):
    """What the native loop's Python side needs of a tcp connection."""

    @property
    def stats(self) -> PlaneStats: ...

    @property
    def node(self) -> Node: ...

    def refuse(self, req_id: int, err: SMBError) -> None: ...


def frames(conn: Connection, header: bytearray, closing: Callable[[], bool]) -> tuple[int, int, int]:
    """Serve natively until a frame is Python's: ``(EV_PYTHON, 0, 0)`` with its header in
    ``header``; ``(EV_EOF, 0, 0)`` at a clean close or once ``closing()``; ``(EV_DROP, why,
    bytes of the header read)`` when the connection cannot go on."""
    assert conn.native is not None
    while True:
        event = conn.native.serve(header, TICK)
        count(conn)
        kind = int(event[0])
        if kind in (_native.EV_PYTHON, _native.EV_EOF):
            return kind, 0, 0
        if kind == _native.EV_DROP:
            return kind, int(event[1]), int(event[2])
        if kind == _native.EV_TICK:
            if closing():
                return _native.EV_EOF, 0, 0
            continue
        answer(conn, event)


def answer(conn: Connection, event: tuple[int | float, ...]) -> None:
    """Answer an event of the loop (module docstring)."""
    kind, req_id = int(event[0]), int(event[1])
    node = conn.node
    err: SMBError
    if kind == _native.EV_HAND_BACK:
        extent_id, offset, length, client, seq, word, parties, round_, dtype = (int(v) for v in event[2:11])
        left = float(event[11])
        pull = requests.Pull(Op.PULL, req_id, extent_id, offset, length, client, seq,
                             ref=rounds.ChunkRound(word, parties, round_), timeout=max(left, 0.0), dtype=dtype)
        tcp_sums.hand_back(conn, node, pull, left)
        return
    if kind == _native.EV_REFUSED:
        code, old, word, parties, round_, root = (int(v) for v in event[2:8])
        err = rounds.refusal(code, old, rounds.ChunkRound(word, parties, round_, bool(root)))
    elif kind == _native.EV_ABSENT:
        err = collective_ops.absent(int(event[2]), int(event[3]), int(event[4]), float(event[5]))
    else:   # EV_NOT_OPEN: released, or its mutations go another way now (a move began)
        extent_id = int(event[2])
        gone = int(event[3]) == _native.XT_DEAD or not _live(node, extent_id)
        err = (ExtentNotFound(f"extent {extent_id} was released during the push") if gone
               else node.replication.moved(extent_id))
    conn.refuse(req_id, err)


def count(conn: Connection) -> None:
    """Add what the loop served since the last look to the plane's statistics."""
    assert conn.native is not None
    operations, accumulated, read, errors, served, busy, waits = conn.native.counters()
    if waits:   # before the rest: what sees these sees the waits that served them
        conn.stats.add(payload_waits=waits)
    if operations or errors:
        conn.stats.add(operations=operations, bytes_accumulated=accumulated, bytes_read=read, errors=errors)
    for _ in range(served):   # each at the tick's mean: the loop keeps no histogram of its own
        conn.stats.observe("reduce", busy / served)


def register(conn: Connection, ticket: Ticket | None, extent_id: int) -> None:
    """Let the loop serve the connection's next REDUCEs of the extent: one was served
    the Python way, so ``ticket`` (the one letting it write the extent, expiring last)
    was checked; until it expires."""
    if conn.native is None or ticket is None:
        return
    try:
        extent = conn.node.arena.get(extent_id)
    except SMBError:
        return
    conn.native.register(extent_id, extent.native, ticket.expires_at)


def _live(node: Node, extent_id: int) -> bool:
    try:
        return node.arena.get(extent_id).live
    except SMBError:
        return False
