"""The shared-memory data plane, for a client on the memory server's host.

The server hands over each extent's file descriptor on a Unix socket (SCM_RIGHTS)
after checking the ticket; the client maps it and copies at memcpy speed. A read-only
ticket gets a read-only descriptor and a read-only mapping. Operations that must stay
atomic on the server (accumulate, scale, axpy, atomics) go to the same server through
the tcp session the data plane names (``options["arithmetic"]``, asked for on every use,
so that a server that restarted on a new tcp port is reached there).

Every mapped extent starts with a 4096-byte header page; the word at byte 8 is 1 while
the server holds the extent, 0 once it is released, so a deleted region is noticed
(its memory was also punched out, so stale mappings read zeros, never new data), and 2
while every mutation must go through the server: the extent is a replicated copy, or
one being moved to another server, whose copy is filled from this one while clients
keep writing. A write looks at the word before and after its copy: 2 before, it goes to
the server instead; 2 after (the server started a copy meanwhile, which may have read
the range before these bytes landed), the same bytes go through the server again, which
applies and forwards them. Between the copy and the second look a lock is taken and
let go (a full memory barrier), so that the look cannot be ordered before the copy's
stores. The server sets the word before it starts copying.

A session also keeps one idle connection to the server's socket open, its liveness
channel: the kernel closes it when the server process ends, however it ends, so the
session sees end-of-file on it at once. Every copy checks the channel before and after
(a non-blocking peek); once it is closed the session raises ServerUnavailable and
refuses every (ticket, extent) mapped before, even after a restarted server listens on
the same path again (its memory is not the one mapped). A ticket the session has not
seen is asked for again over a new channel.

Request on the socket: u32 ticket length | ticket | u64 extent id.
Answer: u8 status | u32 message length | message | u64 extent length, and the
descriptor as ancillary data on success.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from smb_protocol.addressing import Endpoint
from smb_protocol.dtypes import DType
from smb_protocol.errors import (
    ExtentNotFound,
    OutOfRange,
    PermissionDenied,
    ProtocolError,
    ServerUnavailable,
    status_error,
)
from smb_protocol.rounds import ChunkRound

from . import Session, register

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
LIVE_OFFSET = 8
LIVE, LIVE_THROUGH_SERVER = 1, 2   # the live word while the server holds the extent
_BARRIER = threading.Lock()        # taken and let go between a copy and the look after it
MAX_GRANTS = 4096      # (ticket, extent) grants remembered before forgetting them all
MAX_DEAD = 65536       # (ticket, extent) grants of dead channels remembered (oldest forgotten)
REQUEST_HEAD = struct.Struct("<I")
EXTENT_ID = struct.Struct("<Q")
ANSWER_HEAD = struct.Struct("<BI")
CONNECT_RETRY = 0.005  # seconds between connects while the server's backlog is full
GIL_FREE_COPY = 64 << 10   # bytes from which copies go through numpy, which releases the GIL


def _connect(path: str, timeout: float) -> socket.socket:
    """A socket connected to ``path`` (the caller owns it), with ``timeout`` set. A
    connect with a timeout fails at once (EAGAIN) while the server's backlog is full,
    so it is tried again until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the server's backlog stayed full for {timeout} s") from None
            time.sleep(CONNECT_RETRY)
        except BaseException:
            sock.close()
            raise


def _refused(path: str) -> PermissionDenied:
    """The error for a socket this user may not connect to."""
    return PermissionDenied(
        f"shm://{path}: user {os.getuid()} may not connect to this memory server's shm socket; "
        f"join the group that may reach it (the server's state directory) or use "
        f"transport='tcp' (SMB_TRANSPORT=tcp)")


def fetch_extent_fd(path: str, ticket: str, extent_id: int, timeout: float = 10.0) -> tuple[int, int, bool]:
    """Ask the server at ``path`` for an extent's descriptor; returns (fd, length in
    bytes, whether the descriptor is writable, i.e. the ticket allows writes)."""
    token = ticket.encode()
    try:
        with _connect(path, timeout) as sock:
            sock.sendall(REQUEST_HEAD.pack(len(token)) + token + EXTENT_ID.pack(extent_id))
            data, fds, _flags, _addr = socket.recv_fds(sock, 64 << 10, 1)
            while len(data) < ANSWER_HEAD.size:
                more = sock.recv(64 << 10)
                if not more:
                    raise ServerUnavailable(f"shm://{path}: connection closed")
                data += more
            status, n = ANSWER_HEAD.unpack_from(data)
            need = ANSWER_HEAD.size + n + (EXTENT_ID.size if status == 0 else 0)
            while len(data) < need:
                more = sock.recv(need - len(data))
                if not more:
                    raise ServerUnavailable(f"shm://{path}: connection closed")
                data += more
    except PermissionError:
        raise _refused(path) from None
    except OSError as exc:
        raise ServerUnavailable(f"shm://{path}: {exc}") from None
    message = data[ANSWER_HEAD.size:ANSWER_HEAD.size + n].decode(errors="replace")
    if status != 0:
        for fd in fds:
            os.close(fd)
        raise status_error(status, f"shm://{path}: {message}")
    if not fds:
        raise ProtocolError(f"shm://{path}: no descriptor passed")
    (length,) = EXTENT_ID.unpack_from(data, ANSWER_HEAD.size + n)
    writable = fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    return fds[0], length, writable


_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)   # an int once: the enum's | costs a microsecond


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; large copies through numpy, which drops the GIL while it copies,
    so that the requests of one operation (one per server) copy on several cores."""
    if len(dst) < GIL_FREE_COPY:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class _Channel:
    """An idle connection to the server's socket; closed by the kernel when the server
    process ends. Never written to: anything readable on it means the server is gone."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        try:
            self.sock = _connect(path, timeout)
            self.sock.setblocking(False)
        except OSError as exc:
            if isinstance(exc, PermissionError):
                raise _refused(path) from None
            raise ServerUnavailable(f"shm://{path}: {exc}") from None
        self.dead = False

    def alive(self) -> bool:
        if self.dead:
            return False
        try:
            self.sock.recv(1, _PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            pass
        self.dead = True   # end-of-file, an answer nobody asked for, or a reset
        return False

    def close(self) -> None:
        self.dead = True
        self.sock.close()


class _Mapping:
    def __init__(self, fd: int, length: int, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            self.mm = mmap.mmap(fd, HEADER_BYTES + length, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.length = length
        self.writable = writable
        self.data = memoryview(self.mm)[HEADER_BYTES:]
        self.live = np.frombuffer(self.mm, dtype="<u8", count=1, offset=LIVE_OFFSET)

    def check(self, extent_id: int) -> None:
        if self.live[0] not in (LIVE, LIVE_THROUGH_SERVER):
            raise ExtentNotFound(f"extent {extent_id} was released (region deleted, or moved)")

    @property
    def direct(self) -> bool:
        """Clients may write into this mapping (the server says so, and it is writable)."""
        return self.writable and self.live[0] == LIVE

    def close(self) -> None:
        try:
            self.data.release()
        except BufferError:  # a copy still uses a slice of it; the GC unmaps later
            return
        del self.live
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the GC unmaps later
            pass


class ShmSession(Session):
    """Maps extents of one server for every region of a client; delegates server-side
    arithmetic to ``options["arithmetic"]``: a callable returning the :class:`Session`
    of the same server the data plane now lists (called on every use), or that session
    itself. The caller owns that session (this session does not close it).

    Each (ticket, extent) is shown to the server once; one mapping per extent serves
    every ticket the server accepted for it, writable once a read-write ticket got it.
    A read-only ticket does not write through a mapping made for a read-write one: the
    session remembers what the server granted each ticket.
    """

    scheme = "shm"

    def __init__(self, endpoint: Endpoint, options: dict[str, Any] | None = None) -> None:
        options = dict(options or {})
        self.path = endpoint.path
        arithmetic = options.get("arithmetic")
        self._arithmetic: Callable[[], Session] | None = (
            (lambda: arithmetic) if isinstance(arithmetic, Session) else arithmetic)
        self._maps: dict[int, _Mapping] = {}
        self._granted: dict[tuple[str, int], bool] = {}   # (ticket, extent) -> may write
        self._dead: OrderedDict[tuple[str, int], None] = OrderedDict()  # mapped from a dead server
        self._channel: _Channel | None = None
        self._lock = threading.Lock()

    def _gone(self) -> ServerUnavailable:
        return ServerUnavailable(f"shm://{self.path}: the memory server ended; what it "
                                 f"held is no longer reachable through this mapping")

    def _check_live(self, channel: _Channel) -> None:
        """Raise ServerUnavailable once ``channel`` (the one a mapping was made under)
        is closed; forgets every mapping made under it."""
        if channel.alive():
            return
        with self._lock:
            if self._channel is channel:
                self._retire()
        raise self._gone()

    def _retire(self) -> None:
        """Under the lock: the channel died; refuse what was granted under it from now on."""
        for key in self._granted:
            self._dead[key] = None
        while len(self._dead) > MAX_DEAD:
            self._dead.popitem(last=False)
        self._granted.clear()
        self._maps.clear()   # unmapped once no copy uses them
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _map(self, ticket: str, extent_id: int, write: bool = False) -> tuple[_Mapping, _Channel, bool]:
        """The extent's mapping, the channel it was made under, and whether ``ticket`` may
        write into it, once the server has accepted ``ticket`` for it."""
        key = (ticket, extent_id)
        m = self._maps.get(extent_id)
        granted = self._granted.get(key)
        channel = self._channel
        if m is None or granted is None or channel is None or (granted and not m.writable) \
                or (write and not granted and m.live[0] == LIVE):
            with self._lock:
                if self._channel is not None and not self._channel.alive():
                    self._retire()
                if key in self._dead:
                    raise self._gone()
                if self._channel is None:
                    self._channel = _Channel(self.path)
                channel = self._channel
                m = self._maps.get(extent_id)
                granted = self._granted.get(key)
                if m is None or granted is None or (granted and not m.writable) \
                        or (write and not granted and m.live[0] == LIVE):
                    # a read-write ticket refused writing while the extent was replicated
                    # or moving is granted it again once the extent takes direct writes
                    fd, length, granted = fetch_extent_fd(self.path, ticket, extent_id)
                    if len(self._granted) >= MAX_GRANTS:
                        self._granted.clear()   # asking the server again is harmless
                    self._granted[key] = granted
                    if m is None or (granted and not m.writable):
                        m = self._maps[extent_id] = _Mapping(fd, length, granted)
                        # a replaced read-only mapping is unmapped once no view of it is left
                    else:
                        os.close(fd)
        m.check(extent_id)   # released (a region deleted, a clean stop) says so first
        # the server's liveness is checked once, after the copy (by the caller): a copy
        # into or out of a dead server's memory is then reported, never taken for done
        return m, channel, bool(granted)

    def _bounds(self, m: _Mapping, extent_id: int, offset: int, length: int) -> None:
        if offset < 0 or offset + length > m.length:
            raise OutOfRange(f"range [{offset}, {offset + length}) outside extent {extent_id} "
                             f"of {m.length} bytes")

    def write(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
              seq: int = 0) -> None:
        """A copy into the mapping (running it again writes the same bytes), or through
        the server with ``seq`` while the server says so (module docstring)."""
        m, channel, granted = self._map(ticket, extent_id, write=True)
        self._bounds(m, extent_id, offset, sum(len(b) for b in buffers))
        if not (granted and m.direct):   # the server decides (a read-only ticket: ReadOnly)
            self._server().write(ticket, extent_id, offset, buffers, seq)
            return
        pos = offset
        for b in buffers:
            _copy(m.data[pos:pos + len(b)], b)
            pos += len(b)
        with _BARRIER:
            pass
        if m.live[0] == LIVE_THROUGH_SERVER:
            self._server().write(ticket, extent_id, offset, buffers, seq)
            return
        m.check(extent_id)
        self._check_live(channel)   # died meanwhile: nobody will read what we wrote

    def read_into(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None:
        m, channel, _ = self._map(ticket, extent_id)
        self._bounds(m, extent_id, offset, sum(len(b) for b in buffers))
        pos = offset
        for b in buffers:
            _copy(b, m.data[pos:pos + len(b)])
            pos += len(b)
        m.check(extent_id)  # released meanwhile: what we copied may be zeros
        self._check_live(channel)

    def _server(self) -> Session:
        if self._arithmetic is None:
            raise ServerUnavailable(f"shm://{self.path}: server offers no tcp endpoint for arithmetic")
        return self._arithmetic()

    def accumulate(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None, seq: int = 0) -> None:
        self._server().accumulate(ticket, extent_id, offset, buffers, dtype, alpha, seq)

    def scale(self, ticket: str, extent_id: int, offset: int, length: int, dtype: DType, alpha: float,
              seq: int = 0) -> None:
        self._server().scale(ticket, extent_id, offset, length, dtype, alpha, seq)

    def fetch_add(self, ticket: str, extent_id: int, offset: int, value: int, seq: int = 0) -> int:
        return self._server().fetch_add(ticket, extent_id, offset, value, seq)

    def fetch_add_many(self, ticket: str, extent_id: int, items: Sequence[tuple[int, int]],
                       seq: int = 0) -> list[int]:
        return self._server().fetch_add_many(ticket, extent_id, items, seq)

    def compare_swap(self, ticket: str, extent_id: int, offset: int, expected: int, desired: int,
                     seq: int = 0) -> int:
        return self._server().compare_swap(ticket, extent_id, offset, expected, desired, seq)

    def wait(self, ticket: str, extent_id: int, offset: int, cond: int, target: int,
             timeout: float) -> int:
        return self._server().wait(ticket, extent_id, offset, cond, target, timeout)

    def lock(self, ticket: str, extent_id: int, offset: int, holder: int, lease: float,
             timeout: float) -> int:
        return self._server().lock(ticket, extent_id, offset, holder, lease, timeout)

    def unlock(self, ticket: str, extent_id: int, offset: int, holder: int) -> int:
        return self._server().unlock(ticket, extent_id, offset, holder)

    def push(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview], dtype: int,
             ref: ChunkRound, timeout: float, seq: int = 0) -> int:
        return self._server().push(ticket, extent_id, offset, buffers, dtype, ref, timeout, seq)

    def pull(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
             ref: ChunkRound, timeout: float, seq: int = 0, dtype: int = 0, length: int | None = None) -> None:
        self._server().pull(ticket, extent_id, offset, buffers, ref, timeout, seq, dtype, length)

    def close(self) -> None:
        """Unmaps every extent; the arithmetic session belongs to the caller."""
        with self._lock:
            maps, self._maps = self._maps, {}
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        for m in maps.values():
            m.close()


register("shm", ShmSession)
