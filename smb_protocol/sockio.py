"""The loops that read a socket (and the helpers the sending loops of
:mod:`smb_protocol.wire` share): whole frames straight into the caller's buffers, TLS
sockets handed to :mod:`smb_protocol.tls`; re-exported by :mod:`smb_protocol.wire`.
"""
from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Sequence

from smb_protocol import tls

from .errors import ServerUnavailable

IOV_MAX = 512               # buffers handed to one sendmsg/recvmsg_into


def consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (a send or a receive moved them): the
    views they fill are removed, a view they end inside is cut at that byte."""
    while n and views:
        head = len(views[0])
        if n >= head:
            n -= head
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def wait_ready(sock: socket.socket, writing: bool, timeout: float | None) -> None:
    """Wait until a non-blocking ``sock`` has bytes to read (or room to write:
    ``writing``), an end of file or an error, for at most ``timeout`` seconds (None: no
    limit); TimeoutError once that passed."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if writing else select.POLLIN)
    if not poller.poll(None if timeout is None else max(0.0, timeout) * 1000.0):
        raise TimeoutError(f"the socket was not {'writable' if writing else 'readable'} "
                           f"within {timeout:.3g} s")


def recv_into_all(sock: socket.socket, buffers: Sequence[memoryview],
                  deadline: float | None = None) -> None:
    """Fill every buffer, in order, straight from the socket (no copies).

    ``deadline`` (a :func:`time.monotonic` time): raise TimeoutError once it passes,
    however slowly the bytes trickle in (a socket with a timeout gets it set as it goes;
    a non-blocking one, timeout 0, is read with one syscall a time while bytes are
    there, and polled only when they are not).
    """
    if isinstance(sock, ssl.SSLSocket):   # no recvmsg_into on TLS sockets
        tls.recv_into_all(sock, buffers, deadline)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    timeout = sock.gettimeout()
    left_bytes = sum(len(v) for v in views)
    marking = left_bytes >= LOWAT_MIN    # a header or a small body never sets the mark
    lowat = 1
    try:
        while views:
            if marking:
                lowat = _low_water(sock, lowat, left_bytes)
            got = _recv_some(sock, views, timeout, deadline, lowat > 1)
            if got is None:
                continue
            if got == 0:
                raise ServerUnavailable("connection closed by peer")
            consume(views, got)
            left_bytes -= got
    finally:
        if lowat != 1:
            _low_water(sock, lowat, 0)


#: a read waiting for at least this many more bytes sets the socket's low-water mark
#: (``SO_RCVLOWAT``) to them, at most :data:`LOWAT_MAX`: the kernel then wakes the
#: reader once for them, not once per few segments. Such a read never sleeps inside a
#: receive: a receive that took part of the bytes and then slept would not be woken by
#: the rest (the kernel wakes a sleeper when the bytes not yet taken reach the mark, and
#: the rest is fewer than the mark), so it polls, then takes what is there
LOWAT_MIN = 32 << 10        # the native readers take the same rule from smb_protocol/_lowat.h
LOWAT_MAX = 1 << 20


def _low_water(sock: socket.socket, lowat: int, left: int) -> int:
    """Set ``sock``'s low-water mark for a read of ``left`` more bytes (one byte below
    :data:`LOWAT_MIN`; never above ``left``: the kernel would not wake the reader for
    fewer), when it is not ``lowat`` already; returns the mark now set."""
    want = 1 if left < LOWAT_MIN else min(left, LOWAT_MAX)
    if want != lowat:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        except OSError:    # a closed socket: the read itself says so
            return lowat
    return want


def _recv_some(sock: socket.socket, views: list[memoryview], timeout: float | None,
               deadline: float | None, marked: bool) -> int | None:
    """Bytes one receive moved into ``views`` (None: none yet, the socket is now
    readable). ``timeout``: the socket's when the read began (0: non-blocking, None:
    blocking); ``marked``: a low-water mark above one byte is set."""
    if timeout == 0.0 or (timeout is None and deadline is None and marked):
        try:   # a blocking socket's receive must not sleep with a part taken (see LOWAT_MIN)
            return sock.recvmsg_into(views[:IOV_MAX], 0, 0 if timeout == 0.0 else socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("the frame's deadline passed") from None
            wait_ready(sock, False, left)
            return None
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the frame's deadline passed")
        sock.settimeout(left)
    return sock.recvmsg_into(views[:IOV_MAX])[0]


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        recv_into_all(sock, [memoryview(buf)])
    return buf
