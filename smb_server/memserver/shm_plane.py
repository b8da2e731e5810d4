"""The shared-memory data plane: extent descriptors handed over a Unix socket.

A client on the server's host asks for an extent with its ticket; the server checks
the ticket and passes the extent's descriptor with ``SCM_RIGHTS``. The client maps the
whole descriptor (the header page of :mod:`.arena` and the data) and copies at memcpy
speed; it watches the header's live word to notice a release.

Request (little-endian): u32 ticket length | ticket | u64 extent id.
Answer: u8 status | u32 message length | message, then, on success only, u64 extent
length (data bytes), with the descriptor as ancillary data of the same send.
Several requests may follow on one connection; a malformed request closes it. A
connection refused (the plane is full, or out of file descriptors) gets one answer
with status ``SERVER_BUSY`` and is closed. A connection counts against the limits once
it presented a valid ticket; until then it counts against ``max_unauthenticated``
connections, the oldest of which is evicted to make room (see :mod:`.listener`).

What a client receives cannot reach beyond its ticket when the client runs as another
user than the server:

- every extent is a memfd, also a file-backed one (the server writes it back to its
  file; the file's descriptor never leaves the server), sealed against shrinking,
  growing and further seals (:mod:`.arena`): no client can make the server's mapping
  fault (SIGBUS) or change what others map;
- an extent of a replicated region (a primary or a backup, :mod:`.replication`) is
  handed out read-only whatever the ticket: its mutations go to the primary's tcp plane,
  which forwards them, so no client may write it behind the server's back;
- a read-only ticket gets a read-only descriptor (the memfd reopened ``O_RDONLY``
  through the server's ``/proc/self/fd``). It cannot be mapped writable, ``mprotect``
  cannot make its mapping writable, and reopening it through the client's own
  ``/proc/self/fd`` is refused, because the memfd's mode is 0600 and the server's user
  owns it.

A client of the server's own user is trusted with everything the server holds: it can
reopen a descriptor read-write through ``/proc`` as the owner, and it could inspect the
server process itself (``ptrace``, ``/proc/PID/mem``). Which users may ask at all is
decided by who can reach the socket: it is made mode 0666 (``SOCKET_MODE``), so the
permissions of the directories on its path decide (under the systemd unit, the state
directory is 0750 and group ``smb``: members of that group). Tickets decide the rest.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time

from smb_protocol import wire
from smb_protocol.errors import SMBError, Status, error_status
from smb_protocol.tickets import verify

from .access import check_access
from .listener import Listener
from .node import Node
from .plane import ListeningPlane
from .stats import PlaneStats

log = logging.getLogger(__name__)

REQUEST_HEAD = struct.Struct("<I")
EXTENT_ID = struct.Struct("<Q")
ANSWER_HEAD = struct.Struct("<BI")
FRAME_TIMEOUT = 10.0   # seconds a started request may stall
MAX_CONNECTIONS = 256   # connections open at once (shm_connections_max)
MAX_PER_USER = 128      # ... from one user id; each client process keeps one (shm_connections_per_user)
MAX_UNAUTHENTICATED = 64  # ... that have not presented a valid ticket yet; one more evicts one
BACKLOG = 64
SOCKET_MODE = 0o666     # every user who can reach the path may ask; the ticket decides


class _Drop(Exception):
    """Malformed request or peer gone: close this connection."""


class ShmPlane(ListeningPlane):
    """Serves extent descriptors on the Unix socket ``socket_path`` (created here,
    removed by :meth:`close`). Borrows ``node`` (its arena; its secret verifies tickets). At most
    ``max_connections`` connections are open, ``max_per_user`` of them from one user id
    (so that one local user cannot lock the others out); one more, or one accepted while
    the process is out of file descriptors, gets a ``SERVER_BUSY`` answer and is closed.
    Connections count from their first valid ticket; before it, at most
    ``max_unauthenticated`` are kept (the oldest is evicted for a new one).
    Accepting and admission are a :class:`.listener.Listener`'s, owned here.
    """

    def __init__(self, node: Node, socket_path: str,
                 stats: PlaneStats | None = None, *,
                 max_connections: int = MAX_CONNECTIONS, max_per_user: int = MAX_PER_USER,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED) -> None:
        self.node = node
        self.path = os.path.abspath(socket_path)
        self.stats = stats if stats is not None else PlaneStats("shm")
        self._listener = Listener(self.path, self._serve, name="shm", stats=self.stats,
                                  max_connections=max_connections, max_per_peer=max_per_user,
                                  max_setting="shm_connections_max",
                                  per_peer_setting="shm_connections_per_user",
                                  max_unauthenticated=max_unauthenticated,
                                  unauthenticated_setting="shm_connections_unauthenticated",
                                  refusal=_refusal,
                                  backlog=BACKLOG)
        try:
            os.chmod(self.path, SOCKET_MODE)
        except OSError:
            self._listener.close()
            raise
        log.info("shm data plane listening on %s", self.path)

    @property
    def endpoint(self) -> str:
        return f"shm://{self.path}"

    # -- one connection ---------------------------------------------------------------
    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(FRAME_TIMEOUT)
            while not self.closing:
                head = self._recv(sock, REQUEST_HEAD.size, idle_ok=True)
                if head is None:
                    break
                (n,) = REQUEST_HEAD.unpack(head)
                if n > wire.MAX_TICKET:
                    raise _Drop(f"ticket of {n} bytes exceeds {wire.MAX_TICKET}")
                body = self._recv(sock, n + EXTENT_ID.size)
                assert body is not None
                (extent_id,) = EXTENT_ID.unpack_from(body, n)
                self._answer(sock, bytes(body[:n]), extent_id)
        except _Drop as exc:
            self.stats.add(errors=1)
            log.info("shm: closing connection: %s", exc)
        except Exception:
            self.stats.add(errors=1)
            log.exception("shm: unexpected failure; closing connection")

    def _recv(self, sock: socket.socket, n: int, idle_ok: bool = False) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except TimeoutError:
                if idle_ok and got == 0 and not self.closing:
                    continue
                raise _Drop("request stalled") from None
            except OSError as exc:
                raise _Drop(str(exc)) from None
            if k == 0:
                if idle_ok and got == 0:
                    return None
                raise _Drop(f"truncated request ({got} of {n} bytes)")
            got += k
        return buf

    def _answer(self, sock: socket.socket, token: bytes, extent_id: int) -> None:
        start = time.perf_counter()
        try:
            ticket = verify(self.node.secret, token.decode(errors="replace"))
            extent = check_access(ticket, self.node.arena, extent_id, write=False)
            self._listener.current().authenticated()   # counted from now on (listener.py)
            with extent.pin():
                writable = ticket.mode.writes and not self.node.replication.role(extent_id)
                fd = extent.fd if writable else os.open(f"/proc/self/fd/{extent.fd}",
                                                        os.O_RDONLY | os.O_CLOEXEC)
                try:
                    frame = ANSWER_HEAD.pack(Status.OK, 0) + EXTENT_ID.pack(extent.length)
                    socket.send_fds(sock, [frame], [fd])
                finally:
                    if not writable:
                        os.close(fd)
            self.stats.add(operations=1)
            log.debug("shm: passed extent %d (%s)", extent_id, "rw" if writable else "ro")
        except SMBError as exc:
            self.stats.add(operations=1, errors=1)
            message = str(exc).encode()
            log.debug("shm: extent %d refused: %s", extent_id, exc)
            try:
                sock.sendall(ANSWER_HEAD.pack(error_status(exc), len(message)) + message)
            except OSError as err:
                raise _Drop(str(err)) from None
        except OSError as exc:
            raise _Drop(str(exc)) from None
        self.stats.observe("attach", time.perf_counter() - start)

    def _closed(self) -> None:
        log.info("shm data plane on %s closed", self.path)   # the listener removed the socket file


def _refusal(err: SMBError) -> bytes:
    """The answer a refused connection gets in place of its first one."""
    message = str(err).encode()
    return ANSWER_HEAD.pack(error_status(err), len(message)) + message
