"""The listening side every stream data plane shares: bind, accept, admit, serve, close.

A :class:`Listener` owns one listening socket (TCP on ``(host, port)``, or a Unix
socket on a path, which it creates with mode 0600 and removes on close), one accept
thread, and one thread per admitted connection. The plane gives it ``serve``, which
serves one connection until it ends, and ``refusal``, the bytes a refused connection
gets before it is closed (the plane's own wire format for a ``SERVER_BUSY`` answer).

Admission: at most ``max_connections`` connections open in all, and ``max_per_peer``
from one peer (TCP: one address; a Unix socket: one user id, from ``SO_PEERCRED``); an ``admit``
callback may refuse more. A refused connection is answered, never left hanging, and
counted as ``refused`` in the plane's stats; warnings about refusals are rate-limited.

Unauthenticated connections (``max_unauthenticated`` set, as the tcp and shm planes do):
a connection counts against those limits only once its plane says it authenticated
(:meth:`.admission.Admission.authenticated`, called on the connection's own thread: the tcp plane's
first valid ``HELLO``, the shm plane's first valid ticket). Until then it counts only
against a budget of its own, ``max_unauthenticated`` connections in all: one more
evicts the oldest unauthenticated connection of the peer holding the most of them (it
gets the plane's refusal, then its socket is shut down; counted as ``evicted``), much as
sshd's ``MaxStartups`` sheds unauthenticated sessions. A flood of connections that never
authenticate, even from the client's own address, so delays but never locks out a
client that completes its greeting; a new connection is still refused at once while the
authenticated ones of its peer, or of the whole listener, are at their limit, and one
that authenticates past a limit gets :class:`ServerBusy` from ``authenticated()``.
Without ``max_unauthenticated`` every connection counts from its accept. The counting
is :class:`.admission.Ledger`'s.

The accept loop survives EMFILE/ENFILE: it keeps a spare descriptor, closes it to
accept and refuse the waiting connection, then takes it back; other accept failures
back off from :data:`ACCEPT_BACKOFF_FIRST` to :data:`ACCEPT_BACKOFF_MAX` seconds while
existing connections are still served.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from smb_protocol.errors import ServerBusy, SMBError

from .admission import Admission, Ledger
from .stats import PlaneStats

log = logging.getLogger(__name__)

ACCEPT_POLL = 0.5            # seconds between checks for close() in the accept loop
BACKLOG = 128                # connections the kernel queues before accept
ACCEPT_BACKOFF_FIRST = 0.05  # seconds the accept loop pauses after a failure, doubling
ACCEPT_BACKOFF_MAX = 1.0     # seconds, the longest such pause
REFUSAL_LOG_EVERY = 10.0     # seconds between warnings about refused (or evicted) connections
UNIX_MODE = 0o600            # permissions of a Unix socket file
LOCAL_PEER = "local"         # the peer key of a Unix-socket connection whose user is unknown
PEERCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid

#: serves one connection (socket, peer name) until it ends; the listener closes the socket
Serve = Callable[[socket.socket, str], None]
#: the bytes sent to a refused connection before it is closed (may be empty)
Refusal = Callable[[SMBError], bytes]
#: an extra admission check on a peer key: the error to refuse with, or None to admit
Admit = Callable[[str], SMBError | None]


def _peer_uid(sock: socket.socket) -> int | None:
    """The user id of a Unix-socket peer, None when the kernel does not say."""
    try:
        _pid, uid, _gid = PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    except OSError:
        return None
    return int(uid)


def _no_refusal(err: SMBError) -> bytes:
    return b""


class Listener:
    """Listens on ``address`` (``(host, port)``, port 0 for any free one; or a Unix
    socket path) and serves each admitted connection with ``serve`` on its own thread.

    ``name`` labels logs and threads (``tcp``, ``shm``); ``stats`` receives the
    ``sessions`` gauge and ``refused`` counts. ``max_setting``/``per_peer_setting`` name
    the settings that raise the limits in refusal messages. Starts accepting on
    construction; :meth:`close` stops accepting, shuts every connection down and waits
    for the threads. Thread-safe.
    """

    def __init__(self, address: tuple[str, int] | str, serve: Serve, *, name: str,
                 stats: PlaneStats | None = None, max_connections: int = 1024,
                 max_per_peer: int | None = None, refusal: Refusal = _no_refusal,
                 admit: Admit | None = None, max_setting: str = "",
                 per_peer_setting: str = "", backlog: int = BACKLOG,
                 max_unauthenticated: int | None = None, unauthenticated_setting: str = "") -> None:
        self.name = name
        self.stats = stats if stats is not None else PlaneStats(name)
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_unauthenticated = max_unauthenticated
        self.closing = False
        self._serve_fn = serve
        self._refusal = refusal
        self._admit_fn = admit
        self._ledger = Ledger(max_connections, max_per_peer, max_unauthenticated, max_setting,
                              per_peer_setting, unauthenticated_setting)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._local = threading.local()              # .admission: the connection this thread serves
        self._refused_since_log = 0
        self._refusal_logged = -REFUSAL_LOG_EVERY
        self.path: str | None = None
        self._spare = self._open_spare()
        try:
            self._sock = self._bind(address, backlog)
        except BaseException:
            self._close_spare()
            raise
        self.address: tuple[str, int] | str = (self.path if self.path is not None
                                               else self._sock.getsockname()[:2])
        label = self.path if self.path is not None else str(self.port)
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept-{label}",
                                        daemon=True)
        self._thread.start()

    def _bind(self, address: tuple[str, int] | str, backlog: int) -> socket.socket:
        if isinstance(address, str):
            self.path = os.path.abspath(address)
            if os.path.exists(self.path):
                os.unlink(self.path)  # a socket left by a previous run
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if self.path is None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
            else:
                sock.bind(self.path)
                os.chmod(self.path, UNIX_MODE)
            sock.listen(backlog)
            sock.settimeout(ACCEPT_POLL)
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def port(self) -> int:
        """The bound TCP port; 0 for a Unix socket."""
        if self.path is not None:
            return 0
        return int(self.address[1])

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    @property
    def unauthenticated(self) -> int:
        """Connections admitted that have not authenticated (nor been evicted) yet."""
        with self._lock:
            return self._ledger.pending

    def current(self) -> Admission:
        """The connection served on the calling thread (a thread running ``serve``);
        RuntimeError on any other thread."""
        admission: Admission | None = getattr(self._local, "admission", None)
        if admission is None:
            raise RuntimeError(f"{self.name}: current() called outside a connection's thread")
        return admission

    # -- accepting ------------------------------------------------------------------
    @staticmethod
    def _open_spare() -> int:
        """A descriptor held back so that a refusal can be sent when the process has no
        other one left; -1 when even that fails."""
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    def _close_spare(self) -> None:
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1

    def _accept_loop(self) -> None:
        backoff = ACCEPT_BACKOFF_FIRST
        while not self.closing:
            try:
                sock, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.closing:
                    break
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._shed():
                    continue
                log.warning("%s accept failed: %s; pausing %.2f s (existing connections are "
                            "still served)", self.name, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, ACCEPT_BACKOFF_MAX)
                continue
            backoff = ACCEPT_BACKOFF_FIRST
            self._admit(sock, addr)

    def _peer(self, addr: Any, sock: socket.socket | None = None) -> tuple[str, str]:
        """(peer key for the per-peer limit, peer name for logs): a TCP peer's address, a
        Unix-socket peer's user id."""
        if self.path is not None:
            uid = _peer_uid(sock) if sock is not None else None
            if uid is None:
                return LOCAL_PEER, LOCAL_PEER
            return f"uid {uid}", f"local uid {uid}"
        ip = str(addr[0])
        return ip, f"{ip}:{addr[1]}"

    def _shed(self) -> bool:
        """Out of descriptors: accept the waiting connection with the spare one and refuse
        it. False when there was no spare or nothing to accept."""
        if self._spare < 0:
            self._spare = self._open_spare()
            return False
        self._close_spare()
        try:
            sock, addr = self._sock.accept()
        except OSError:
            return False
        finally:
            if self._spare < 0:
                self._spare = self._open_spare()
        self._refuse(sock, self._peer(addr)[1], ServerBusy(
            "the memory server is out of file descriptors; retry later, or raise its "
            "descriptor limit (LimitNOFILE= in the systemd unit, ulimit -n)"))
        if self._spare < 0:   # the socket closed above freed one
            self._spare = self._open_spare()
        return True

    def _limit_refusal(self, key: str) -> SMBError | None:
        """Why a connection from ``key`` is not counted now, or None. Holds the lock."""
        if self.closing:
            return ServerBusy("the memory server is stopping")
        return self._ledger.refusal(key)

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        key, peer = self._peer(addr, sock)
        refusal = self._admit_fn(key) if self._admit_fn is not None else None
        evicted: Admission | None = None
        if refusal is None:
            with self._lock:
                refusal = self._limit_refusal(key)
                if refusal is None:
                    admission = Admission(sock, key, peer, self._authenticate)
                    thread = threading.Thread(target=self._run, args=(admission,),
                                              name=f"{self.name}-{peer}", daemon=True)
                    self._conns[sock] = thread
                    evicted = self._ledger.add(admission)
                    if evicted is not None:   # its socket is still open: its thread holds the lock to end
                        self._evict(evicted)
        if refusal is not None:
            self._refuse(sock, peer, refusal)
            return
        if evicted is not None:
            self._log_shed(evicted.peer, "evicted", self._ledger.eviction_error())
        thread.start()

    def _evict(self, victim: Admission) -> None:
        """An evicted connection gets the plane's refusal (sent without blocking), then its
        socket is shut down, which ends its thread. Holds the lock."""
        self.stats.add(evicted=1)
        try:
            frame = self._refusal(self._ledger.eviction_error())
            if frame:
                victim.sock.send(frame, socket.MSG_DONTWAIT)
        except OSError:
            pass
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _authenticate(self, admission: Admission) -> None:
        with self._lock:
            refusal = self._ledger.authenticate(admission)
        if refusal is not None:   # stays pending (and evictable) until the plane closes it
            self._log_shed(admission.peer, "refused after authenticating", refusal)
            self.stats.add(refused=1)
            raise refusal

    def _refuse(self, sock: socket.socket, peer: str, err: SMBError) -> None:
        """Answer a connection that is not taken with the plane's refusal for ``err``, then
        close it. Never blocks: the answer fits in a fresh socket's send buffer."""
        self.stats.add(refused=1)
        try:
            frame = self._refusal(err)
            sock.setblocking(False)
            if frame:
                sock.send(frame)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):   # read what already came, so close() sends FIN, not RST
                pass
        except OSError:
            pass
        finally:
            sock.close()
        self._log_shed(peer, "refused", err)

    def _log_shed(self, peer: str, what: str, err: SMBError) -> None:
        """Warn about a refused or evicted connection, at most every REFUSAL_LOG_EVERY
        seconds (with a count of those in between)."""
        now = time.monotonic()
        self._refused_since_log += 1
        if now - self._refusal_logged >= REFUSAL_LOG_EVERY:
            log.warning("%s %s: %s (%d refused or evicted since the last such warning): %s",
                        self.name, peer, what, self._refused_since_log, err)
            self._refusal_logged = now
            self._refused_since_log = 0

    # -- serving --------------------------------------------------------------------
    def _run(self, admission: Admission) -> None:
        sock, peer = admission.sock, admission.peer
        self._local.admission = admission
        self.stats.add(sessions=1)
        try:
            log.debug("%s %s: connected", self.name, peer)
            self._serve_fn(sock, peer)
        except OSError as exc:
            log.info("%s %s: %s", self.name, peer, exc)
        except Exception:
            self.stats.add(errors=1)
            log.exception("%s %s: unexpected failure; closing connection", self.name, peer)
        finally:
            self.stats.add(sessions=-1)
            self._local.admission = None
            with self._lock:
                self._conns.pop(sock, None)
                self._ledger.remove(admission)
            sock.close()
            log.debug("%s %s: closed", self.name, peer)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, shut every connection down, wait for the threads (seconds in
        all), remove a Unix socket file. Idempotent."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
            conns = list(self._conns.items())
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for sock, _thread in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        for _sock, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._close_spare()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

