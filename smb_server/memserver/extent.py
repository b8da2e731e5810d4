"""One extent: a mapped memfd of a header page and the data, and its file.

Every extent lives in a memfd (``os.memfd_create``) of one 4096-byte header page followed by
``length`` data bytes, and the server maps all of it. The memfd is what shared-memory clients
receive, so it is made safe to hand out before anyone sees it: mode 0600 (a client of another
user cannot reopen it through ``/proc/self/fd``, so a read-only descriptor stays read-only) and
sealed ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` (nobody, the server included, can change
its size, so no mapping of it can fault with SIGBUS, and no client can add a seal such as
``F_SEAL_FUTURE_WRITE``).

When persistence is asked for and the arena has a ``data_dir``, the extent also has a file
``<data_dir>/<extent_id>.extent`` (mode 0600, same layout) that no client ever gets a descriptor
of: the server writes the memfd back into it every ``writeback_seconds`` (a background thread)
and when it stops, and copies the file into a fresh memfd when a restarted server adopts it.
Only the parts holding data are copied (``SEEK_DATA``), so untouched memory stays unallocated. A
clean stop (SIGTERM) loses nothing; a killed server loses nothing either while its keeper
(:mod:`.keeper`) holds the memfd, and what was written since the last write-back when the keeper
dies with it. An extent costs one file descriptor (its memfd): the mapping (:class:`Mapping`)
keeps none of its own, and the file is opened only while it is written or read. The arena
refuses a new extent with :class:`OutOfMemory` while fewer than ``fd_reserve`` descriptors are
left under the process's ``RLIMIT_NOFILE`` (sockets and files need some too);
:func:`raise_fd_limit` (in :mod:`.memmap`) lifts the soft limit to the hard one.

Header page layout (all integers little-endian):

====== ======= ============================================================
offset  size    field
====== ======= ============================================================
0       u64     magic ``HEADER_MAGIC`` ("SMBEXT01")
8       u64     live word: 1 while the server holds the extent and clients may write
                its mapping, 2 while it holds it but every mutation must go through
                the server (a replicated extent, or one being moved), 0 once released
16      u64     extent_id
24      u64     length of the data part, bytes
32      64      region_uid, UTF-8, NUL-padded
====== ======= ============================================================

Release order: the live word is set to 0 *first*, then the data pages are punched out
(``fallocate(PUNCH_HOLE)``), so memory goes back to the kernel even while a client still maps
the descriptor (its mapping then reads zeros), then the server unmaps and closes (and unlinks a
file). A client that checks the live word after copying never mistakes zeros for data.

Concurrency: the arena's table is guarded by one lock; each extent has ``lock`` that serializes
read-modify-write operations (accumulate, scale, axpy, atomics; a pthread mutex, which native
code takes too) and a pin count: data planes :meth:`Extent.pin` an extent for the duration of an
operation, and the final unmap of a released extent waits until the last pin is dropped and the
native requests on it (``native``, counted in C: blocked while its mutations must go through
Python, waited for before the unmap) end.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from smb_protocol.errors import ExtentNotFound, InvalidArgument, OutOfRange

from . import _native
from .memmap import Mapping, data_ranges, punch_hole

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
HEADER_MAGIC = int.from_bytes(b"SMBEXT01", "little")
LIVE_OFFSET = 8
LIVE, LIVE_THROUGH_SERVER = 1, 2   # values of the live word while the extent is held
UID_OFFSET = 32
UID_BYTES = 64
HEADER = struct.Struct("<QQQQ64s")   # magic, live, extent_id, length, region_uid
FILE_SUFFIX = ".extent"

COPY_CHUNK = 64 << 20    # bytes per read or write call when copying between memfd and file
MEMFD_MODE = 0o600       # a client of another user cannot reopen a handed-out memfd
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def make_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes (zeros), mode 0600, its size sealed; the caller owns it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.fchmod(fd, MEMFD_MODE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view[:COPY_CHUNK], offset)
        view = view[n:]
        offset += n


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view[:COPY_CHUNK]], offset)
        if n == 0:
            raise ValueError(f"file ends before byte {offset}")
        view = view[n:]
        offset += n


def encode_uid(region_uid: str) -> bytes:
    """The uid as stored in the header; InvalidArgument when it is too long."""
    raw = region_uid.encode()
    if len(raw) > UID_BYTES:
        raise InvalidArgument(f"region uid {region_uid!r} is longer than {UID_BYTES} bytes")
    return raw


class Extent:
    """One contiguous piece of memory: a mapped memfd or file of header + ``length`` bytes.

    The arena owns the extent (descriptor and mapping); callers borrow ``data``,
    ``fd`` and arrays only while they hold a :meth:`pin`.
    """

    def __init__(self, extent_id: int, region_uid: str, length: int, fd: int,
                 mm: Mapping, path: str = "", persistent: bool = False) -> None:
        self.extent_id = extent_id
        self.region_uid = region_uid
        self.length = length            # bytes of data (header excluded)
        self.fd = fd                    # the memfd, owned; closed when the extent is retired
        self.path = path                # the file it is written back to, "" for memory only
        self.persistent = persistent
        self.created = time.monotonic()
        self.lock = _native.Mutex()
        self._mm = mm
        assert mm.view is not None
        self._header = mm.view[:HEADER_BYTES]
        self.data = mm.view[HEADER_BYTES:HEADER_BYTES + length]  # writable, bytes
        self.native = _native.ExtentHandle(extent_id, self.data, self.lock)
        self._state = threading.Lock()
        self._pins = 0
        #: a collective slot's sum narrowed to its wire type, by slot offset: (round, dtype
        #: byte, bytes), made by the round's first pull and sent to every party from there
        self.narrowed: dict[int, tuple[int, int, memoryview]] = {}
        self._released = False
        self._keep_data = False
        self._closed = False
        self._file = threading.Lock()   # one write-back at a time; the final unlink after it
        self.retire_hooks: list[Callable[[Extent], None]] = []  # run before the memory goes

    # -- making one -----------------------------------------------------------------
    @classmethod
    def create(cls, extent_id: int, region_uid: str, length: int, path: str = "") -> Extent:
        """A new live extent of ``length`` zero bytes; with ``path`` also its file (written
        as ``path + ".new"``, then renamed into place). The caller owns it."""
        size = HEADER_BYTES + length
        fd = make_memfd(f"smb-extent-{extent_id}", size)
        try:
            mm = Mapping(fd, size)
            extent = cls(extent_id, region_uid, length, fd, mm, path, persistent=bool(path))
            extent._write_header(1)
            if path:
                with extent._file:
                    extent._write_file(path + ".new")
                os.rename(path + ".new", path)
        except BaseException:
            os.close(fd)
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path + ".new")
            raise
        return extent

    @classmethod
    def adopt(cls, path: str) -> Extent:
        """The extent a file holds, copied into a fresh memfd (the file stays closed);
        OSError or ValueError when the file is not a whole extent. The caller owns it."""
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"file of {size} bytes has no header page")
            magic, _live, extent_id, length, raw_uid = HEADER.unpack(os.pread(fd, HEADER.size, 0))
            if magic != HEADER_MAGIC:
                raise ValueError(f"bad magic {magic:#x}")
            if size != HEADER_BYTES + length or length == 0:
                raise ValueError(f"header says {length} data bytes but the file has {size} bytes")
            if os.path.basename(path) != f"{extent_id}{FILE_SUFFIX}":
                raise ValueError(f"header names extent {extent_id}")
            region_uid = raw_uid.rstrip(b"\0").decode()
            memfd = make_memfd(f"smb-extent-{extent_id}", size)
            try:
                mm = Mapping(memfd, size)
                assert mm.view is not None
                for offset, n in data_ranges(fd, 0, size):
                    _read_all(fd, mm.view[offset:offset + n], offset)
            except BaseException:
                os.close(memfd)
                raise
        extent = cls(extent_id, region_uid, length, memfd, mm, path, persistent=True)
        extent._set_live(1)
        return extent

    @property
    def address(self) -> int:
        """Virtual address of the first data byte in this process (for registrations)."""
        probe = np.frombuffer(self.data, dtype=np.uint8, count=1)
        try:
            return int(probe.ctypes.data)
        finally:
            del probe

    # -- header ---------------------------------------------------------------------
    def _write_header(self, live: int) -> None:
        HEADER.pack_into(self._header, 0, HEADER_MAGIC, live, self.extent_id, self.length,
                         encode_uid(self.region_uid))

    def _set_live(self, live: int) -> None:
        struct.pack_into("<Q", self._header, LIVE_OFFSET, live)

    def direct_writes(self, allowed: bool) -> None:
        """Tell clients that map the extent (and the native loop) whether they may write it
        themselves (live word 1) or must send every mutation through the server (2), which
        forwards it to the extent's copies. Set under the extent's lock before a sync starts: a
        client's copy that ends after this sees it and sends its bytes again through the server
        (:mod:`smb_client.transports.shm`). Nothing once released."""
        with self._state:
            if not self._released:
                self._set_live(LIVE if allowed else LIVE_THROUGH_SERVER)
                self.native.open() if allowed else self.native.block(0)   # Replication drains it

    @property
    def live(self) -> bool:   # while the arena holds the extent
        return not self._released

    @property
    def age(self) -> float:
        """Seconds since this process reserved or adopted the extent."""
        return time.monotonic() - self.created

    # -- access ---------------------------------------------------------------------
    def pin(self) -> _Pin:
        """Keep the mapping alive for one operation (a ``with`` block); raises
        ExtentNotFound once released."""
        return _Pin(self)

    def _unpin(self) -> None:
        with self._state:
            self._pins -= 1
            last = self._released and self._pins == 0
        if last:
            self._close()

    def check_range(self, offset: int, length: int) -> None:
        """Raise OutOfRange unless ``[offset, offset+length)`` lies in the data part."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise OutOfRange(f"range [{offset}, {offset + length}) outside extent "
                             f"{self.extent_id} of {self.length} bytes")

    def array(self, dtype: np.dtype | str, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A writable numpy view of ``nbytes`` data bytes from ``offset`` (no copy)."""
        if nbytes is None:
            nbytes = self.length - offset
        self.check_range(offset, nbytes)
        dt = np.dtype(dtype)
        return np.frombuffer(self.data[offset:offset + nbytes], dtype=dt, count=nbytes // dt.itemsize)

    # -- persistence ----------------------------------------------------------------
    def write_back(self) -> int:
        """Copy the extent into its file (file-backed extents; others do nothing) and
        flush it to disk; returns the data bytes copied. Raises ExtentNotFound once
        released."""
        if not self.path:
            return 0
        with self.pin(), self._file:
            return self._write_file(self.path)

    def _write_file(self, path: str) -> int:
        """Under ``_file`` with the mapping alive: make ``path`` hold this extent. The
        header comes from this object, not from the mapped page, which read-write clients
        can write; the data comes from the memfd."""
        assert self._mm.view is not None
        size = HEADER_BYTES + self.length
        header = bytearray(HEADER_BYTES)
        HEADER.pack_into(header, 0, HEADER_MAGIC, int(not self._released), self.extent_id,
                         self.length, encode_uid(self.region_uid))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            _write_all(fd, memoryview(header), 0)
            copied = 0
            pos = HEADER_BYTES
            for offset, n in data_ranges(self.fd, HEADER_BYTES, size):
                self._zero_file(fd, pos, offset - pos)   # a hole in memory is zeros in the file
                _write_all(fd, self._mm.view[offset:offset + n], offset)
                copied += n
                pos = offset + n
            self._zero_file(fd, pos, size - pos)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return copied

    @staticmethod
    def _zero_file(fd: int, offset: int, length: int) -> None:
        """Make ``[offset, offset+length)`` of the file read as zeros (a hole where the
        file system can; nothing to do where the file has a hole already)."""
        if length <= 0 or not data_ranges(fd, offset, offset + length):
            return
        if not punch_hole(fd, offset, length):
            zeros = memoryview(bytes(min(length, COPY_CHUNK)))
            while length > 0:
                _write_all(fd, zeros[:length], offset)
                offset += min(length, len(zeros))
                length -= min(length, len(zeros))

    # -- retirement -----------------------------------------------------------------
    def retire(self, keep_data: bool = False) -> None:
        """Mark released (live word 0 first), give the memory back; unmap when unpinned
        (the arena's, once it dropped the extent from its table). ``keep_data``: a persistent
        extent at server shutdown: write back, keep the file; else the data pages are punched
        out and a backing file is deleted."""
        with self._state:
            if self._released:
                return
            self._released = True
            self._keep_data = keep_data
            pinned = self._pins > 0
        self._set_live(0)
        self.native.block(0)   # none starts now; _close waits for those running
        for hook in self.retire_hooks:
            try:
                hook(self)
            except Exception:
                log.exception("extent %d: retire hook failed", self.extent_id)
        self.retire_hooks = []
        if not keep_data:
            self._punch()
        if not pinned:
            self._close()

    def _punch(self) -> None:
        try:
            punch_hole(self.fd, HEADER_BYTES, self.length)
        except OSError as exc:
            log.warning("extent %d: cannot punch out its memory: %s", self.extent_id, exc)

    def _close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
        self.native.close()
        if self._keep_data:
            with self._file:
                try:
                    self._write_file(self.path)
                except OSError as exc:
                    log.error("extent %d: cannot write it back to %s: %s", self.extent_id,
                              self.path, exc)
        else:
            self._punch()  # again: an operation that was pinned may have touched pages
        self._header.release()
        self.data.release()
        try:
            self._mm.close()   # unmapped now, or when the last borrowed view is collected
        except BufferError:
            log.debug("extent %d: mapping still exported; unmapped when collected", self.extent_id)
        if self.path and not self._keep_data:
            with self._file, contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)

    def __repr__(self) -> str:
        return (f"Extent(id={self.extent_id}, region_uid={self.region_uid!r}, length={self.length}, "
                f"persistent={self.persistent}, live={self.live})")


class _Pin:
    """One pin of an extent (:meth:`Extent.pin`): a plain class, as this runs several
    times for every request (a generator's context manager costs twice as much)."""

    __slots__ = ("extent",)

    def __init__(self, extent: Extent) -> None:
        self.extent = extent

    def __enter__(self) -> Extent:
        extent = self.extent
        with extent._state:
            if extent._released:
                raise ExtentNotFound(f"extent {extent.extent_id} was released")
            extent._pins += 1
        return extent

    def __exit__(self, *exc: object) -> None:
        self.extent._unpin()
