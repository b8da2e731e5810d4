"""TLS on the tcp data plane (:mod:`.tcp_plane`): the server side of a connection's
handshake, on the connection's own thread, and the linger after a refused one."""
from __future__ import annotations

import logging
import socket
import ssl
import time

from .stats import PlaneStats

log = logging.getLogger(__name__)

GOODBYE_LINGER = 1.0   # seconds a dropped or refused connection is read (and discarded) after its
                       # parting answer, so that the close is no reset


def handshake(tls: ssl.SSLContext, sock: socket.socket, hello_timeout: float, stats: PlaneStats,
              peer: str) -> ssl.SSLSocket | None:
    """The TLS server side of ``sock``, after a handshake that must end within
    ``hello_timeout`` seconds; None (logged, counted) when it fails. Runs on the
    connection's thread. The TLS socket wraps a duplicate descriptor, so that the
    listener's shutdown of ``sock`` at close reaches it too."""
    dup = sock.dup()
    try:
        dup.settimeout(hello_timeout)
        return tls.wrap_socket(dup, server_side=True)
    except OSError as exc:   # ssl.SSLError, a timeout, a reset
        dup.close()
        stats.add(errors=1, dropped=1)
        log.info("tcp %s: TLS handshake failed: %s", peer, exc)
        linger(sock)
        return None


def linger(sock: socket.socket) -> None:
    """Stop sending, then read and discard what the peer still sends for up to
    :data:`GOODBYE_LINGER` seconds, so that the close is a FIN behind the TLS alert that
    refused the peer, not a reset that loses it (a TLS 1.3 client sends its first request
    before it learns that its certificate was refused)."""
    end = time.monotonic() + GOODBYE_LINGER
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass
