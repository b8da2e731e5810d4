"""Serving the coordination requests of the data planes: ``WAIT``, ``LOCK``, ``UNLOCK``
(formats in :mod:`smb_protocol.wire`), on the arena's :class:`.waiters.Waiters` table.

A waiting request holds the thread serving its connection (answers go in order), so
clients send waits on connections of their own (see ``smb_client/coord.py``). The wait
ends early, without an answer, when the client closes the connection or the plane
closes.
"""
from __future__ import annotations

import logging
import select
import socket
import struct

from smb_protocol.errors import InvalidArgument, Misaligned
from smb_protocol.requests import Lock, Wait
from smb_protocol.wire import Op, WaitCond

from .arena import Extent
from .waiters import Applied, Cancelled, Waiters

log = logging.getLogger(__name__)

_WORD = struct.Struct("<q")


def serve(waiters: Waiters, req: Wait | Lock, extent: Extent, cancelled: Cancelled,
          applied: Applied | None = None) -> bytes:
    """Run one checked coordination request (ticket and range already checked); returns
    the answer body: the word's value as 8 bytes. ``applied(word)`` runs under the
    extent's lock once a LOCK or UNLOCK changed the word (see :meth:`Waiters.lock`)."""
    name = req.op.name.lower()
    if req.length != 8:
        raise InvalidArgument(f"{name} works on one 8-byte word, not {req.length} bytes")
    if req.offset % 8:
        raise Misaligned(f"{name} needs an 8-byte aligned offset, not {req.offset}")
    if isinstance(req, Wait):
        try:
            cond = WaitCond(req.cond)
        except ValueError:
            raise InvalidArgument(f"unknown wait condition {req.cond}: expected one of "
                                  + ", ".join(f"{c.value} ({c.name.lower()})" for c in WaitCond)) from None
        word = waiters.wait(extent, req.offset, cond, req.value, req.timeout, cancelled)
    elif req.op is Op.LOCK:
        word = waiters.lock(extent, req.offset, req.holder, req.lease, req.timeout, cancelled, applied)
    else:
        word = waiters.unlock(extent, req.offset, req.holder, applied)
    return _WORD.pack(word)


def word(value: int) -> bytes:
    """An int64 word's 8 bytes (the answer of a coordination request)."""
    return _WORD.pack(value)


def peer_closed(sock: socket.socket) -> bool:
    """True when the peer of ``sock`` has closed it (end of file waiting, not consumed)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        # the plain socket's recv: a TLS socket refuses flags; a peek at its raw bytes
        # tells end of file all the same
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:   # another thread of the connection read what was there
        return False
    except (OSError, ValueError):
        return True
