"""The shared-memory data plane: extent descriptors handed over a Unix socket.

A client on the server's host asks for an extent with its ticket; the server checks
the ticket and passes the extent's descriptor with ``SCM_RIGHTS``. The client maps the
whole descriptor (the header page of :mod:`.arena` and the data) and copies at memcpy
speed; it watches the header's live word to notice a release.

Request (little-endian): u32 ticket length | ticket | u64 extent id.
Answer: u8 status | u32 message length | message, then, on success only, u64 extent
length (data bytes), with the descriptor as ancillary data of the same send.
Several requests may follow on one connection; a malformed request closes it.

A read-only ticket gets a read-only descriptor (the extent reopened ``O_RDONLY``
through ``/proc/self/fd``), which cannot be mapped writable. This guards against
mistakes, not against a hostile process of the same user, which could reopen the
descriptor through ``/proc`` itself.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

from smb_client import wire
from smb_client.errors import SMBError, Status, error_status
from smb_client.tickets import verify

from .access import ACCEPT_POLL, check_access
from .arena import Arena
from .stats import PlaneStats

log = logging.getLogger(__name__)

REQUEST_HEAD = struct.Struct("<I")
EXTENT_ID = struct.Struct("<Q")
ANSWER_HEAD = struct.Struct("<BI")
FRAME_TIMEOUT = 10.0   # seconds a started request may stall
MAX_CONNECTIONS = 256


class _Drop(Exception):
    """Malformed request or peer gone: close this connection."""


class ShmPlane:
    """Serves extent descriptors on the Unix socket ``socket_path`` (created here,
    removed by :meth:`close`). Borrows ``arena``; ``secret`` verifies tickets.
    """

    def __init__(self, arena: Arena, secret: bytes, socket_path: str,
                 stats: PlaneStats | None = None) -> None:
        self.arena = arena
        self.secret = secret
        self.path = os.path.abspath(socket_path)
        self.stats = stats if stats is not None else PlaneStats("shm")
        self.closing = False
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        if os.path.exists(self.path):
            os.unlink(self.path)  # a socket left by a previous run
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            os.chmod(self.path, 0o600)
            self._listener.listen(64)
            self._listener.settimeout(ACCEPT_POLL)
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="shm-accept", daemon=True)
        self._thread.start()
        log.info("shm data plane listening on %s", self.path)

    @property
    def endpoint(self) -> str:
        return f"shm://{self.path}"

    def _accept_loop(self) -> None:
        while not self.closing:
            try:
                sock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self.closing:
                    log.warning("shm accept failed: %s", exc)
                    time.sleep(0.05)
                continue
            with self._lock:
                ok = len(self._conns) < MAX_CONNECTIONS and not self.closing
                if ok:
                    thread = threading.Thread(target=self._serve, args=(sock,), name="shm-conn", daemon=True)
                    self._conns[sock] = thread
            if not ok:
                log.warning("shm: refused a connection (%d open)", MAX_CONNECTIONS)
                sock.close()
                continue
            thread.start()

    # -- one connection ---------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        self.stats.add(sessions=1)
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
        finally:
            self.stats.add(sessions=-1)
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

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
            ticket = verify(self.secret, token.decode(errors="replace"))
            extent = check_access(ticket, self.arena, extent_id, write=False)
            with extent.pin():
                writable = ticket.mode.writes
                fd = extent.fd if writable else os.open(f"/proc/self/fd/{extent.fd}",
                                                        os.O_RDONLY | os.O_CLOEXEC)
                try:
                    frame = ANSWER_HEAD.pack(Status.OK, 0) + EXTENT_ID.pack(extent.length)
                    socket.send_fds(sock, [frame], [fd])
                finally:
                    if not writable:
                        os.close(fd)
            self.stats.add(operations=1)
            log.debug("shm: passed extent %d (%s)", extent_id, ticket.mode.value)
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

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, remove the socket file."""
        if self.closing:
            return
        self.closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _thread in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout)
        for _sock, thread in conns:
            thread.join(timeout)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        log.info("shm data plane on %s closed", self.path)

    def __enter__(self) -> ShmPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
