"""The client side of one tcp data-plane connection, without I/O (frames in, answers out).

Every client connection kind speaks through a :class:`ClientFrames`: the pooled
request-answer connection (``smb_client/transports/tcp.py``), the pipelined collective
stream (``smb_client/transports/stream.py``) and a primary's forwarder to its backups.
It numbers requests (never 0: ``req_id`` 0 marks a server's refusal or parting answer),
makes ``HELLO`` frames for tickets the connection has not presented yet (a bounded set:
beyond :data:`MAX_PRESENTED` it forgets them all, and presenting again is harmless),
packs typed requests (:mod:`smb_protocol.requests`), and reads answer headers and error
bodies into typed errors. The caller owns the socket and moves the bytes; so a second
connection kind cannot drift from the first in what it sends or how it reads answers.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from . import tracing, wire
from .errors import ProtocolError, SMBError, status_error
from .requests import Hello, Request
from .wire import Op

__all__ = ["MAX_PRESENTED", "Answer", "ClientFrames"]

MAX_PRESENTED = 1024    # tickets a connection remembers having presented before forgetting them all


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer header: ``status`` (0: OK), ``kind`` (:data:`~smb_protocol.wire.FINAL`
    or :data:`~smb_protocol.wire.PUSHED`), ``req_id`` and the ``length`` of its body."""

    status: int
    kind: int
    req_id: int
    length: int

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def unsolicited(self) -> bool:
        """A refusal of the connection or a parting answer: the server closes after it."""
        return self.req_id == 0 and self.status != 0


class ClientFrames:
    """The frames of one client connection to the server at ``where`` (for messages)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._ids = itertools.count(1)
        self._presented: set[str] = set()

    def next_id(self) -> int:
        """A request number for this connection (never 0)."""
        return next(self._ids) & 0xFFFFFFFF or next(self._ids)

    def hello(self, ticket: str) -> tuple[int, list[bytes]] | None:
        """``(req_id, frames)`` presenting ``ticket``, or None when this connection already
        did; counted as presented from now on (a refusal closes the connection anyway)."""
        if ticket in self._presented:
            return None
        if len(self._presented) >= MAX_PRESENTED:
            self._presented.clear()
        token = ticket.encode()
        req_id = self.next_id()
        self._presented.add(ticket)
        return req_id, [Hello(Op.HELLO, length=len(token)).to_frame(req_id), token]

    def request(self, req: Request, payload: Sequence[memoryview] = ()) -> tuple[int, list[memoryview | bytes]]:
        """``(req_id, frames)`` of ``req`` with its payload buffers; inside a sampled
        trace, with the trace's traceparent between header and payload
        (:data:`~smb_protocol.wire.TRACED`)."""
        req_id = self.next_id()
        trace = tracing.traceparent()
        if trace is None:
            return req_id, [req.to_frame(req_id), *payload]
        return req_id, [req.to_frame(req_id, traced=True), trace, *payload]

    def answer(self, header: bytes | bytearray | memoryview) -> Answer:
        """The answer of a :data:`~smb_protocol.wire.RESPONSE`-sized header
        (ProtocolError for one that is not)."""
        return Answer(*wire.unpack_answer(header))

    def error(self, answer: Answer, body: bytes | bytearray | memoryview) -> SMBError:
        """The typed error an error answer carries (its body is the message)."""
        return status_error(answer.status, f"{self.where}: {bytes(body).decode(errors='replace')}")

    def stray(self, answer: Answer, expected: int | None = None) -> ProtocolError:
        """The error for an answer to no request this connection has in flight."""
        wanted = "" if expected is None else f" (request {expected} is)"
        return ProtocolError(f"{self.where}: an answer to request {answer.req_id}, not in flight{wanted}")
