"""A memory server's end of its keeper (:mod:`.keeper`): the connection, started keeper
included (:class:`KeeperLink`), and the arena listener that hands the keeper every
persistent extent and checks that it lives (:class:`ExtentKeeper`)."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from smb_protocol.errors import ExtentNotFound, ServerError

from .arena import Arena, Extent
from .keeper import LINGER_SECONDS, MESSAGE_BYTES, KeeperError, socket_path, with_address

log = logging.getLogger(__name__)

START_TIMEOUT = 10.0     # seconds a server waits for a keeper it started to listen
REQUEST_TIMEOUT = 30.0   # seconds one request may take
SYNC_TIMEOUT = 600.0     # seconds a take or sync may wait while the keeper writes extents back
CHECK_SECONDS = 2.0      # seconds between a server's checks that its keeper is alive


class KeeperLink:
    """A memory server's connection to the keeper of ``data_dir``, started here when none
    runs. Thread-safe; every method raises :class:`KeeperError` (an OSError) when the
    keeper cannot be reached or refuses."""

    def __init__(self, data_dir: str, linger: float = LINGER_SECONDS) -> None:
        self.data_dir = os.path.abspath(data_dir)
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.path = socket_path(self.data_dir)
        self.linger = linger
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.connect()

    def connect(self) -> None:
        """(Re)connect to the keeper, starting one when none listens."""
        with self._lock:
            self._close_sock()
            sock = self._try_connect()
            if sock is None:
                proc = self._start()
                deadline = time.monotonic() + START_TIMEOUT
                while (sock := self._try_connect()) is None:
                    if proc.poll() is not None:       # failed, or another keeper was first
                        sock = self._try_connect()
                        if sock is None:
                            raise KeeperError(errno.ECHILD, f"the keeper of {self.data_dir} exited "
                                              f"with {proc.returncode}; see the server's log")
                        break
                    if time.monotonic() > deadline:
                        raise KeeperError(errno.ETIMEDOUT, f"no keeper listens on {self.path} "
                                          f"{START_TIMEOUT:g} s after it was started")
                    time.sleep(0.02)
            sock.settimeout(REQUEST_TIMEOUT)
            self._sock = sock

    def _try_connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with_address(self.path, sock.connect)
        except OSError:
            sock.close()
            return None
        return sock

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None:
            self._proc.poll()     # reap one that exited
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "smb_server.memserver.keeper", self.data_dir,
             "--linger", str(self.linger)],
            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        log.info("started the keeper of %s (pid %d)", self.data_dir, self._proc.pid)
        return self._proc

    def _close_sock(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _request(self, request: dict[str, object], fds: list[int] | None = None,
                 timeout: float = REQUEST_TIMEOUT) -> tuple[dict[str, object], socket.socket]:
        """Send one request, read its answer; holds the lock."""
        if self._sock is None:
            raise KeeperError(errno.ENOTCONN, f"not connected to the keeper of {self.data_dir}")
        try:
            self._sock.settimeout(timeout)
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds or [])
            raw = self._sock.recv(MESSAGE_BYTES)
        except OSError as exc:
            self._close_sock()
            raise KeeperError(exc.errno or errno.EPIPE, f"the keeper of {self.data_dir}: {exc}") from None
        if not raw:
            self._close_sock()
            raise KeeperError(errno.EPIPE, f"the keeper of {self.data_dir} closed the connection")
        answer = json.loads(raw)
        if not answer.get("ok"):
            raise KeeperError(errno.EINVAL, f"the keeper refused {request['op']}: {answer.get('error')}")
        return answer, self._sock

    def keep(self, extent_id: int, length: int, region_uid: str, path: str, fd: int) -> None:
        """Hand the keeper a duplicate of memfd ``fd`` of extent ``extent_id`` (``length``
        data bytes of region ``region_uid``, written back to ``path`` in ``data_dir``); it
        holds it once this returns."""
        with self._lock:
            self._request({"op": "keep", "id": extent_id, "length": length, "uid": region_uid,
                           "path": path}, [fd])

    def drop(self, extent_id: int) -> None:
        """The keeper lets go of extent ``extent_id`` (released)."""
        with self._lock:
            self._request({"op": "drop", "id": extent_id})

    def take(self) -> dict[int, tuple[int, int, str]]:
        """Every extent the keeper holds: id -> (memfd, data bytes, region uid); the
        caller owns the descriptors, the keeper keeps its own."""
        with self._lock:
            answer, sock = self._request({"op": "take"}, timeout=SYNC_TIMEOUT)
            out: dict[int, tuple[int, int, str]] = {}
            try:
                for _ in range(int(str(answer["count"]))):
                    raw, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 1)
                    entry = json.loads(raw)
                    if len(fds) != 1:
                        raise KeeperError(errno.EPROTO, "the keeper sent an extent without its memfd")
                    out[int(entry["id"])] = (fds[0], int(entry["length"]), str(entry["uid"]))
            except BaseException:
                for fd, _length, _uid in out.values():
                    os.close(fd)
                self._close_sock()
                raise
            return out

    def ping(self) -> bool:
        """True when the keeper answers."""
        with self._lock:
            try:
                self._request({"op": "ping"})
            except KeeperError:
                return False
            return True

    def sync(self) -> None:
        """Return once the keeper is done writing back what a previous server left (it
        answers nothing before), so that the files in ``data_dir`` are current."""
        with self._lock:
            self._request({"op": "ping"}, timeout=SYNC_TIMEOUT)

    def quit(self) -> None:
        """Tell the keeper to let go of everything and exit (a clean stop, after the
        write-back); best effort."""
        with self._lock:
            with contextlib.suppress(KeeperError):
                self._request({"op": "quit"})
            self._close_sock()
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(5)

    def close(self) -> None:
        """Disconnect, leaving the keeper running (it writes everything back and waits
        for the next server)."""
        with self._lock:
            self._close_sock()


class ExtentKeeper:
    """What a memory server with a ``data_dir`` runs: a :class:`KeeperLink`, and an
    arena listener that hands the keeper every persistent extent when it is made or
    adopted and lets go of it when it is released; a thread checks every
    ``check_seconds`` that the keeper is alive and starts a new one, handing it every
    persistent extent again, when it is not.

    Construct it before the :class:`.arena.Arena`: it waits until the keeper wrote back
    what a crashed predecessor left (so the arena adopts current files), then
    :meth:`attach` the arena. At a clean stop: :meth:`stopping` before the arena closes
    (its extents are written back, not released), :meth:`close` after.
    :func:`open_arena` and :func:`close_arena` do both in that order.
    """

    def __init__(self, data_dir: str, check_seconds: float = CHECK_SECONDS,
                 linger: float = LINGER_SECONDS) -> None:
        self.link = KeeperLink(data_dir, linger)
        self.link.sync()
        self.check_seconds = check_seconds
        self._arena: Arena | None = None
        self._stopping = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, arena: Arena) -> None:
        """Hand the keeper ``arena``'s persistent extents, now and from now on; it lets go
        of what else it held (extents whose files were not adopted)."""
        self._arena = arena
        arena.add_listener(self)
        held = {e.extent_id for e in arena.extents() if e.path}
        for extent_id, (fd, _length, _uid) in self.link.take().items():
            os.close(fd)
            if extent_id not in held:
                log.warning("the keeper held extent %d, whose file was not adopted; dropping it",
                            extent_id)
                self.link.drop(extent_id)
        self._thread = threading.Thread(target=self._check_loop, name="keeper-check", daemon=True)
        self._thread.start()

    # -- ArenaListener ----------------------------------------------------------------
    def extent_added(self, extent: Extent) -> None:
        if not extent.path:
            return
        try:
            self._keep(extent)
        except KeeperError:
            try:
                self._restart()       # keeps every held extent, this one when it is held
                self._keep(extent)
            except KeeperError as exc:
                raise ServerError(
                    f"extent {extent.extent_id}: cannot hand its memory to the keeper of "
                    f"{self.link.data_dir} ({exc}); without it a crash of this server would lose "
                    f"writes to persistent regions, see the server's log") from None

    def extent_retiring(self, extent: Extent) -> None:
        if not extent.path or self._stopping:
            return
        try:
            self.link.drop(extent.extent_id)
        except KeeperError as exc:   # it forgets the extent anyway once its file is gone
            log.warning("extent %d: the keeper did not let go of it: %s", extent.extent_id, exc)

    def _keep(self, extent: Extent) -> None:
        self.link.keep(extent.extent_id, extent.length, extent.region_uid, extent.path, extent.fd)

    # -- health -----------------------------------------------------------------------
    def _restart(self) -> None:
        """A new connection (and keeper, when none runs), handed every persistent extent."""
        self.link.connect()
        if self._arena is None:
            return
        for extent in self._arena.extents():
            if extent.path:
                try:
                    with extent.pin():
                        self._keep(extent)
                except ExtentNotFound:
                    pass              # released meanwhile

    def _check_loop(self) -> None:
        while not self._stop.wait(self.check_seconds):
            if self.link.ping():
                continue
            log.warning("the keeper of %s does not answer; starting a new one", self.link.data_dir)
            try:
                self._restart()
            except KeeperError as exc:
                log.error("cannot restart the keeper of %s: %s; a crash of this server would "
                          "lose what was written since the last write-back", self.link.data_dir, exc)

    # -- stopping ---------------------------------------------------------------------
    def stopping(self) -> None:
        """The arena is about to close: its extents are written back, the keeper keeps
        them until :meth:`close`."""
        self._stopping = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """After the arena closed (files current): the keeper lets go and exits."""
        self.stopping()
        self.link.quit()


def open_arena(capacity: int, data_dir: str, writeback_seconds: float,
               keeper: bool = True) -> tuple[Arena, ExtentKeeper | None]:
    """A memory server's arena (``capacity`` bytes), with the keeper of its persistent
    extents when it has a ``data_dir`` and ``keeper`` is on. The keeper is reached (or
    started) first, so that the arena adopts files it finished writing back."""
    kept = ExtentKeeper(data_dir) if data_dir and keeper else None
    arena = Arena(capacity, data_dir, writeback_seconds=writeback_seconds)
    if kept is not None:
        kept.attach(arena)
    return arena, kept


def close_arena(arena: Arena, keeper: ExtentKeeper | None) -> None:
    """Close ``arena`` (its persistent extents are written back, not released), then
    let the keeper go."""
    if keeper is not None:
        keeper.stopping()
    arena.close()
    if keeper is not None:
        keeper.close()
