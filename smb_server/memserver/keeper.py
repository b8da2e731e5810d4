"""The keeper: a small process that holds the memory of a memory server's persistent
extents, so that what the server acknowledged survives a crash of the server process.

A persistent (file-backed) extent lives in a memfd (:mod:`.arena`); the server writes it
back to its file every ``writeback_seconds``. Without more, ``kill -9`` (the OOM killer, a
segfault) loses what was written since. So the server hands the memfd of every
persistent extent to its keeper, before the extent is used, over a Unix socket with
``SCM_RIGHTS``; the keeper holds it, and the memory stays as long as either holds it.
Writes need nothing more: tcp, rdma and shm all write the same pages, so the hot path
pays nothing.

- The server dies: the keeper sees its connection close, writes every extent whose file
  still exists back to that file (the extents released meanwhile are dropped), and then
  waits up to :data:`LINGER_SECONDS` for a server. A restarted server (same
  ``data_dir``) connects, waits until that write-back is done (the keeper answers
  nothing before), adopts the files and hands the keeper its new memfds: nothing
  acknowledged is lost. After that wait, or once ``data_dir`` is gone, the keeper
  exits; the files are then current. (``take`` hands the held memfds themselves back,
  for a caller that adopts without copying.)
- The keeper gets SIGTERM (systemd stopping the unit's processes after a crash of the
  server): it writes everything back, then exits; the restarted server adopts the files.
- A clean stop: the server writes back, then tells the keeper to quit.
- The keeper dies: the server notices within seconds (a ping), starts a new keeper and
  hands it every persistent extent again.
- The machine crashes: the files hold what the last write-back wrote, as before.

The socket is ``<data_dir>/keeper.sock`` (mode 0600 in the 0700 ``data_dir``); the
keeper also refuses a peer of another user id (``SO_PEERCRED``). One server at a time.
Protocol: ``SOCK_SEQPACKET``, one JSON object per message, descriptors beside it:
``keep`` (id, length, region uid, file; one memfd), ``drop`` (id), ``take`` (answered with one
message per extent, each with its memfd), ``ping``, ``quit``; every request gets
``{"ok": true}`` or ``{"ok": false, "error": ...}``.

Run as ``python -m smb_server.memserver.keeper DATA_DIR``; the server starts it (in a
session of its own, so that signals to the server's process group miss it) through
:mod:`.keeper_link`, its end of the socket.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from .arena import HEADER, HEADER_BYTES, HEADER_MAGIC
from .memmap import data_ranges, punch_hole

log = logging.getLogger(__name__)

SOCKET_NAME = "keeper.sock"
SOCKET_MODE = 0o600
LINGER_SECONDS = 600.0   # seconds a keeper whose server died waits for a new one
POLL_SECONDS = 1.0       # seconds between the keeper's checks for a server and for data_dir
MESSAGE_BYTES = 4096     # the largest message
COPY_CHUNK = 64 << 20    # bytes per pwrite when writing an extent back
PEERCRED = struct.Struct("3i")


class KeeperError(OSError):
    """The keeper refused a request or cannot be reached."""


@dataclass
class _Held:
    fd: int
    length: int        # data bytes
    region_uid: str
    path: str          # the extent's file, in data_dir


def socket_path(data_dir: str) -> str:
    return os.path.join(os.path.abspath(data_dir), SOCKET_NAME)


def _address(path: str) -> tuple[str, int]:
    """An address ``bind``/``connect`` accept for ``path`` (a Unix socket path is at most
    107 bytes: a longer one is reached through ``/proc/self/fd`` of its directory), and
    the directory descriptor to close after the call (-1 when none)."""
    if len(os.fsencode(path)) < 100:
        return path, -1
    dirfd = os.open(os.path.dirname(path), os.O_PATH | os.O_CLOEXEC)
    return f"/proc/self/fd/{dirfd}/{os.path.basename(path)}", dirfd


def with_address(path: str, fn: Callable[[str], None]) -> None:
    """``fn(address)`` (a socket's bind or connect) with an address for ``path``."""
    address, dirfd = _address(path)
    try:
        fn(address)
    finally:
        if dirfd >= 0:
            os.close(dirfd)


def write_back(extent_id: int, held: _Held) -> bool:
    """Write a held extent into its file in place (header from what the server said,
    data from the memfd, holes as zeros), then flush it; False when the file is gone
    (the extent was released)."""
    size = HEADER_BYTES + held.length
    try:
        fd = os.open(held.path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        header = bytearray(HEADER_BYTES)
        HEADER.pack_into(header, 0, HEADER_MAGIC, 1, extent_id, held.length, held.region_uid.encode())
        os.ftruncate(fd, size)
        os.pwrite(fd, header, 0)
        with mmap.mmap(held.fd, size, prot=mmap.PROT_READ) as mm, memoryview(mm) as view:
            pos = HEADER_BYTES
            for offset, n in data_ranges(held.fd, HEADER_BYTES, size):
                _zero(fd, pos, offset - pos)
                for start in range(offset, offset + n, COPY_CHUNK):
                    with view[start:min(offset + n, start + COPY_CHUNK)] as chunk:
                        done = 0
                        while done < len(chunk):
                            done += os.pwrite(fd, chunk[done:], start + done)
                pos = offset + n
            _zero(fd, pos, size - pos)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return True


def _zero(fd: int, offset: int, length: int) -> None:
    """Make ``[offset, offset+length)`` of the file read as zeros."""
    if length <= 0 or not data_ranges(fd, offset, offset + length):
        return
    if not punch_hole(fd, offset, length):
        zeros = bytes(min(length, COPY_CHUNK))
        while length > 0:
            n = os.pwrite(fd, zeros[:length], offset)
            offset += n
            length -= n


# -- the keeper process ---------------------------------------------------------------

class _Stop(Exception):
    """SIGTERM or SIGINT."""


class Keeper:
    """The keeper's state and loop (see the module docstring). ``linger``: seconds to
    wait for a server after the last one went."""

    def __init__(self, data_dir: str, linger: float = LINGER_SECONDS) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.linger = linger
        self.held: dict[int, _Held] = {}
        self._dirty = False        # a server may have changed the extents since the last save
        self.path = socket_path(self.data_dir)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._bind()

    def _bind(self) -> None:
        try:
            with_address(self.path, self.sock.bind)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                with_address(self.path, probe.connect)
            except OSError:               # left by a keeper that is gone
                os.unlink(self.path)
                with_address(self.path, self.sock.bind)
            else:
                raise KeeperError(errno.EADDRINUSE, f"a keeper already serves {self.data_dir}") from None
            finally:
                probe.close()
        os.chmod(self.path, SOCKET_MODE)
        self.sock.listen(1)
        self.sock.settimeout(POLL_SECONDS)

    def run(self) -> None:
        """Serve servers one after the other until told to quit, until no server came for
        ``linger`` seconds, until ``data_dir`` is gone, or until SIGTERM."""
        idle_since = time.monotonic()
        try:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    if not os.path.isdir(self.data_dir):
                        log.info("keeper: %s is gone; exiting", self.data_dir)
                        return
                    if time.monotonic() - idle_since > self.linger:
                        log.info("keeper: no memory server for %.0f s; the files are current; "
                                 "exiting", self.linger)
                        return
                    continue
                with conn:
                    if not self._same_user(conn):
                        continue
                    if self._serve(conn):
                        return
                self._save_all("its memory server went away")
                idle_since = time.monotonic()
        except _Stop:
            self._save_all("stopping")
        finally:
            self.close()

    def _same_user(self, conn: socket.socket) -> bool:
        _pid, uid, _gid = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          PEERCRED.size))
        if uid != os.getuid():
            log.warning("keeper: refusing a peer of uid %d", uid)
            return False
        return True

    def _serve(self, conn: socket.socket) -> bool:
        """Serve one server's requests; True when it said quit. A second server that
        connects meanwhile is told that this one holds ``data_dir``."""
        conn.settimeout(None)
        self._dirty = True
        while True:
            ready, _, _ = select.select([conn, self.sock], [], [])
            if conn not in ready:          # only a newcomer: the served one has not gone
                self._refuse_second(conn)
                continue
            try:
                raw, fds, _flags, _addr = socket.recv_fds(conn, MESSAGE_BYTES, 1)
            except OSError:
                return False
            if not raw:
                for fd in fds:
                    os.close(fd)
                return False
            answer, op = b'{"ok": true}', ""
            try:
                request = json.loads(raw)
                op = request["op"]
                if op == "keep":
                    if len(fds) != 1:
                        raise ValueError("keep needs one descriptor")
                    path = os.path.abspath(str(request["path"]))
                    if os.path.dirname(path) != self.data_dir:
                        raise ValueError(f"{path} is not in {self.data_dir}")
                    self._keep(int(request["id"]), _Held(fds.pop(), int(request["length"]),
                                                         str(request["uid"]), path))
                elif op == "drop":
                    old = self.held.pop(int(request["id"]), None)
                    if old is not None:
                        os.close(old.fd)
                elif op == "quit":
                    self._drop_all()
                elif op not in ("ping", "take"):
                    raise ValueError(f"unknown op {op!r}")
            except (ValueError, KeyError, TypeError) as exc:
                answer, op = json.dumps({"ok": False, "error": str(exc)}).encode(), ""
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                if op == "take":
                    self._give(conn)
                else:
                    conn.send(answer)
            except OSError:
                return False
            if op == "quit":
                self._dirty = False
                return True

    def _refuse_second(self, served: socket.socket) -> None:
        try:
            other, _ = self.sock.accept()
        except OSError:
            return
        with other:
            pid = PEERCRED.unpack(served.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    PEERCRED.size))[0]
            error = (f"memory server pid {pid} uses {self.data_dir} already; give each memory "
                     f"server a data_dir of its own")
            log.warning("keeper: refused a second memory server: %s", error)
            with contextlib.suppress(OSError):
                other.settimeout(1.0)
                other.recv(MESSAGE_BYTES)          # its first request, then the refusal
                other.send(json.dumps({"ok": False, "error": error}).encode())

    def _keep(self, extent_id: int, held: _Held) -> None:
        old = self.held.pop(extent_id, None)
        if old is not None:
            os.close(old.fd)
        self.held[extent_id] = held

    def _give(self, conn: socket.socket) -> None:
        conn.send(json.dumps({"ok": True, "count": len(self.held)}).encode())
        for extent_id, held in self.held.items():
            socket.send_fds(conn, [json.dumps({"id": extent_id, "length": held.length,
                                               "uid": held.region_uid, "path": held.path}).encode()],
                            [held.fd])

    def _save_all(self, why: str) -> None:
        """Write every held extent back (SIGTERM and SIGINT wait until it is done)."""
        if not self.held or not self._dirty:
            return
        start = time.monotonic()
        saved = 0
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            for extent_id, held in list(self.held.items()):
                try:
                    if write_back(extent_id, held):
                        saved += 1
                    else:                      # released: its file is gone
                        os.close(self.held.pop(extent_id).fd)
                except OSError as exc:
                    log.error("keeper: cannot write extent %d back: %s", extent_id, exc)
            self._dirty = False
            log.info("keeper: %s; wrote %d extent(s) back in %.2f s", why, saved,
                     time.monotonic() - start)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _drop_all(self) -> None:
        for held in self.held.values():
            os.close(held.fd)
        self.held.clear()

    def close(self) -> None:
        self._drop_all()
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hold a memory server's persistent extents")
    ap.add_argument("data_dir")
    ap.add_argument("--linger", type=float, default=LINGER_SECONDS,
                    help="seconds to wait for a memory server after the last one went")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s smb-keeper[%(process)d] %(levelname)s %(message)s")
    with contextlib.suppress(OSError):   # the last process the OOM killer should pick
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-900")
    try:
        keeper = Keeper(args.data_dir, args.linger)
    except KeeperError as exc:
        log.info("keeper: %s; exiting", exc)
        return 0
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("keeper: holding the persistent extents of %s", keeper.data_dir)
    keeper.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
