"""The connection a request came from, as the request engine (:mod:`.engine`) and the
operation modules see it: its tickets, its statistics, the request's payload and the
way to answer with data. The tcp plane's connection and the rdma plane's queue pair
each implement :class:`Peer`."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from .access import TicketBook
from .stats import PlaneStats


class Repeat(Exception):
    """A retry of a numbered request whose first attempt failed after taking effect: its
    first answer (status and message body)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body


class Payload(Protocol):
    """The payload bytes of the request being served, in order."""

    #: the most bytes :meth:`take` returns at once
    step: int

    def take(self, n: int) -> memoryview:
        """The next ``n`` (at most :attr:`step`) payload bytes; valid until the next call."""

    def into(self, view: memoryview) -> None:
        """Put the next ``len(view)`` payload bytes straight into ``view``."""


class Whole:
    """A payload already in memory (an rdma staging area), handed out whole (:class:`Payload`)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.step = max(1, len(view))
        self._pos = 0

    def take(self, n: int) -> memoryview:
        chunk = self.view[self._pos:self._pos + n]
        self._pos += n
        return chunk

    def into(self, view: memoryview) -> None:
        view[:] = self.take(len(view))


class Peer(Protocol):
    """The connection a request came from, as the engine sees it."""

    @property
    def name(self) -> str:
        """The peer's address, for logs."""

    @property
    def tickets(self) -> TicketBook:
        """The tickets presented on this connection."""

    @property
    def stats(self) -> PlaneStats:
        """The plane's statistics."""

    @property
    def dedup_wait(self) -> float:
        """Seconds a repeat of a numbered request waits for an attempt still running."""

    @property
    def takes_replicated(self) -> bool:
        """False: mutations of replicated extents are refused here (NotPrimary): they go
        to the primary's tcp plane, which forwards them."""

    def payload(self, length: int) -> AbstractContextManager[Payload]:
        """The request's ``length`` payload bytes, for the duration of the block."""

    def send(self, req_id: int, view: memoryview) -> None:
        """Answer ``req_id`` with ``view``'s bytes (the extent's memory, pinned meanwhile)."""

    def cancelled(self) -> bool:
        """Whether a waiting request should stop (the peer left, or the plane closes)."""
