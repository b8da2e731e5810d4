"""What a client queue pair knows of its server and what it was told: the session's
settings it connects with (:class:`Peer`), the extents a ticket opened
(:class:`TicketKeys`, :class:`RemoteExtent`), and the error that breaks it
(:class:`Broken`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smb_protocol.errors import SMBError


class Broken(Exception):
    """An error completion: the QP is unusable. ``error`` is what the caller sees;
    ``reconnect`` says whether a fresh Connect may fix it (retry once)."""

    def __init__(self, error: SMBError, reconnect: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.reconnect = reconnect


@dataclass(frozen=True)
class RemoteExtent:
    address: int
    rkey: int
    length: int          # bytes


@dataclass(frozen=True)
class TicketKeys:
    """What one ticket opened on a queue pair: its extents here, and write rights."""

    extents: dict[int, RemoteExtent]
    writable: bool


@dataclass(frozen=True)
class Peer:
    """What a queue pair needs of the session that makes it: the server (``where``, for
    messages), the shared device, the gRPC channel of the server's ``Connect`` (a
    callable: opened on first use, owned by the session), the bearer token, the seconds
    ``Connect`` may take, the largest message (bytes; 0: the device's) and the client id
    that numbers requests."""

    where: str
    device: Any
    channel: Callable[[], Any]
    token: str | None
    connect_timeout: float
    max_message: int
    client_id: int
