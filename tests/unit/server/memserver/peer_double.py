"""A double of the engine's :class:`~smb_server.memserver.peer.Peer` for unit tests that
drive the server's own engine, arena and exactly-once table without a plane: tickets
presented up front, a payload given whole, every answer recorded."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from smb_protocol import tickets
from smb_server.memserver.access import TicketBook
from smb_server.memserver.stats import PlaneStats


class Payload:
    """The request's payload bytes, handed out in order."""

    step = 1 << 20

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def into(self, view: memoryview) -> None:
        view[:] = self.take(len(view))


class PeerDouble:
    """A connection that presented ``token`` (signed with ``secret``), whose request
    carries ``payload``; :attr:`answers` records ``(req_id, bytes)`` of every answer sent
    with data, and ``on_send`` runs right after each."""

    def __init__(self, secret: bytes, token: str, payload: bytes = b"",
                 on_send: Callable[[], None] = lambda: None) -> None:
        self.name = "test"
        self.tickets = TicketBook()
        self.tickets.add(tickets.verify(secret, token))
        self.stats = PlaneStats()
        self.dedup_wait = 5.0
        self.takes_replicated = False
        self.answers: list[tuple[int, bytes]] = []
        self._payload = payload
        self._on_send = on_send

    @contextlib.contextmanager
    def payload(self, length: int) -> Iterator[Payload]:
        assert length == len(self._payload), f"a payload of {length} bytes asked, {len(self._payload)} given"
        yield Payload(self._payload)

    def send(self, req_id: int, view: memoryview) -> None:
        self.answers.append((req_id, bytes(view)))
        self._on_send()

    def cancelled(self) -> bool:
        return False
