"""The memory server's capacity budget and the extents carved from it.

Pure state: no gRPC, no sockets. The servicer and the data planes call into it. What
an extent is (its memfd, header page, file and release order) is in :mod:`.extent`;
the libc-level memory helpers live in :mod:`.memmap`. The arena keeps the table of
extents, reserves them against its capacity, adopts the files a previous server left in
``data_dir``, writes file-backed extents back every ``writeback_seconds`` (a thread it
owns) and retires extents when they are released or the arena closes.

Listeners (the rdma plane): :meth:`Arena.add_listener` registers an object whose
``extent_added(extent)`` runs after an extent is created or adopted (it registers the
memory with the RDMA device; an exception there undoes the reservation) and whose
``extent_retiring(extent)`` runs when an extent is released, after the live word is
cleared and *before* its pages are punched out and unmapped (it deregisters the memory,
so old rkeys stop working before the memory can be reused).

Concurrency: the arena's table is guarded by one lock; each extent serializes its own
read-modify-write operations and is pinned by the data planes (:mod:`.extent`).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from smb_protocol.errors import ExtentNotFound, InvalidArgument, OutOfMemory
from smb_protocol.units import format_bytes

from .extent import FILE_SUFFIX, encode_uid
from .extent import HEADER as HEADER  # the header format, where callers have always found it
from .extent import HEADER_BYTES as HEADER_BYTES
from .extent import HEADER_MAGIC as HEADER_MAGIC
from .extent import LIVE_OFFSET as LIVE_OFFSET
from .extent import Extent as Extent
from .memmap import open_fds

log = logging.getLogger(__name__)

FD_RESERVE = 64          # descriptors kept free for sockets and files when reserving extents
WRITEBACK_SECONDS = 10.0  # seconds between write-backs of file-backed extents to their files


class ArenaListener(Protocol):
    """Told about extents as they come and go (see the module docstring)."""

    def extent_added(self, extent: Extent) -> None: ...

    def extent_retiring(self, extent: Extent) -> None: ...


@dataclass(frozen=True)
class HeldExtent:
    """What the arena holds, as reported to the controller."""

    extent_id: int
    region_uid: str
    length: int          # bytes
    age_seconds: float


class Arena:
    """A capacity budget (bytes) and the extents reserved against it.

    ``data_dir``: where file-backed (persistent) extents live; existing ``*.extent``
    files there are adopted on construction, so a restarted server keeps their data.
    ``fd_reserve``: descriptors that must stay free for a new extent to be made.
    ``writeback_seconds``: seconds between write-backs of file-backed extents (a thread
    the arena owns while it has a ``data_dir``; 0: only when the arena closes).
    """

    def __init__(self, capacity: int, data_dir: str = "", fd_reserve: int = FD_RESERVE,
                 writeback_seconds: float = WRITEBACK_SECONDS) -> None:
        if capacity < 0:
            raise InvalidArgument(f"capacity must be >= 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self.data_dir = data_dir
        self.fd_reserve = fd_reserve
        self._lock = threading.Lock()
        self._extents: dict[int, Extent] = {}
        self._used = 0
        self._closed = False
        self._listeners: list[ArenaListener] = []
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        if data_dir:
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
            self._adopt_all()
            if writeback_seconds > 0:
                self._writer = threading.Thread(target=self._write_back_loop, args=(writeback_seconds,),
                                                name="extent-writeback", daemon=True)
                self._writer.start()

    # -- budget ---------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes reserved (data parts; header pages are not counted)."""
        return self._used

    @property
    def free(self) -> int:
        return max(0, self.capacity - self._used)

    def __len__(self) -> int:
        return len(self._extents)

    # -- listeners ------------------------------------------------------------------
    def add_listener(self, listener: ArenaListener) -> None:
        """Tell ``listener`` about every held extent now and every later one."""
        with self._lock:
            self._listeners.append(listener)
            held = list(self._extents.values())
        for extent in held:
            self._announce(extent, [listener])

    def remove_listener(self, listener: ArenaListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _announce(self, extent: Extent, listeners: list[ArenaListener]) -> None:
        for listener in listeners:
            listener.extent_added(extent)
            extent.retire_hooks.append(listener.extent_retiring)

    # -- extents --------------------------------------------------------------------
    def reserve(self, extent_id: int, region_uid: str, length: int, persistent: bool = False) -> Extent:
        """Create extent ``extent_id`` of ``length`` bytes (zeros) for ``region_uid``.

        Idempotent: reserving a held id again for the same region and length returns
        the held extent. Raises OutOfMemory when the budget is exceeded or the process
        is short of file descriptors, InvalidArgument on a zero length or an id held for
        another region or length.
        """
        extent_id = int(extent_id)
        length = int(length)
        if length <= 0:
            raise InvalidArgument(f"extent {extent_id}: length must be > 0 bytes, got {length}")
        if extent_id < 0 or extent_id >= 1 << 64:
            raise InvalidArgument(f"extent id {extent_id} is not a u64")
        encode_uid(region_uid)
        with self._lock:
            if self._closed:
                raise InvalidArgument("the arena is closed")
            held = self._extents.get(extent_id)
            if held is not None:
                if held.region_uid == region_uid and held.length == length:
                    return held
                raise InvalidArgument(
                    f"extent {extent_id} is already held for region {held.region_uid!r} "
                    f"({held.length} bytes); asked for region {region_uid!r} ({length} bytes)")
            if self._used + length > self.capacity:
                raise OutOfMemory(
                    f"cannot reserve {format_bytes(length)} for extent {extent_id}: "
                    f"{format_bytes(self._used)} of {format_bytes(self.capacity)} in use, "
                    f"{format_bytes(self.capacity - self._used)} free")
            self._check_fds(extent_id)
            self._used += length  # claim the budget before the (slow) allocation
        try:
            extent = self._create(extent_id, region_uid, length, persistent)
        except BaseException as exc:
            with self._lock:
                self._used -= length
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                raise self._no_fds(extent_id, soft, soft) from None
            raise
        try:
            self._announce(extent, list(self._listeners))
        except BaseException:
            extent.retire(keep_data=False)
            with self._lock:
                self._used -= length
            raise
        with self._lock:
            self._extents[extent_id] = extent
        log.debug("reserved %r", extent)
        return extent

    def _check_fds(self, extent_id: int) -> None:
        """Raise OutOfMemory when a new extent would leave fewer than ``fd_reserve``
        descriptors free."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return
        try:
            used = open_fds()
        except OSError:
            used = soft               # not even one free to count with
        if used + 1 + self.fd_reserve > soft:
            raise self._no_fds(extent_id, used, soft)

    def _no_fds(self, extent_id: int, used: int, soft: int) -> OutOfMemory:
        return OutOfMemory(
            f"cannot make extent {extent_id}: {used} of {soft} file descriptors are open and "
            f"{self.fd_reserve} are kept for connections (each extent takes one); raise the "
            f"memory server's descriptor limit (LimitNOFILE= in its systemd unit, ulimit -n), "
            f"or place the region on other servers")

    def _create(self, extent_id: int, region_uid: str, length: int, persistent: bool) -> Extent:
        path = ""
        if persistent and self.data_dir:
            path = os.path.join(self.data_dir, f"{extent_id}{FILE_SUFFIX}")
        elif persistent:
            log.info("extent %d: persistence asked for but the server has no data_dir; "
                     "using memory", extent_id)
        return Extent.create(extent_id, region_uid, length, path)

    def release(self, extent_id: int) -> bool:
        """Free an extent and delete its file (once a write-back under way ends); False
        when it was not held."""
        with self._lock:
            extent = self._extents.pop(int(extent_id), None)
            if extent is None:
                return False
            self._used -= extent.length
        extent.retire()
        log.debug("released %r", extent)
        return True

    def get(self, extent_id: int) -> Extent:
        """The held extent; raises ExtentNotFound."""
        extent = self._extents.get(extent_id)
        if extent is None:
            raise ExtentNotFound(f"extent {extent_id} is not held by this memory server")
        return extent

    def extents(self) -> list[Extent]:
        with self._lock:
            return list(self._extents.values())

    def held(self) -> list[HeldExtent]:
        """(id, region uid, length, age seconds) of every held extent."""
        return [HeldExtent(e.extent_id, e.region_uid, e.length, e.age) for e in self.extents()]

    def write_back(self) -> int:
        """Write every file-backed extent back to its file now; returns data bytes copied.
        A failure is logged and the others are still written."""
        copied = 0
        for extent in self.extents():
            if not extent.path:
                continue
            try:
                copied += extent.write_back()
            except ExtentNotFound:
                pass                       # released meanwhile: its file is gone too
            except OSError as exc:
                log.error("extent %d: cannot write it back to %s: %s", extent.extent_id,
                          extent.path, exc)
        return copied

    def _write_back_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            start = time.monotonic()
            copied = self.write_back()
            log.debug("wrote back %d bytes of file-backed extents in %.3f s", copied,
                      time.monotonic() - start)

    def close(self) -> None:
        """Drop every extent: memory ones are freed, file-backed ones are written back
        and their files stay for a restart."""
        self._stop.set()
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join()
        with self._lock:
            self._closed = True
            extents, self._extents = list(self._extents.values()), {}
            self._used = 0
        for extent in extents:
            extent.retire(keep_data=bool(extent.path))

    # -- persistence ----------------------------------------------------------------
    def _adopt_all(self) -> None:
        for stale in glob.glob(os.path.join(glob.escape(self.data_dir), "*" + FILE_SUFFIX + ".new")):
            log.info("removing %s: a reservation the previous server did not finish", stale)
            with contextlib.suppress(OSError):
                os.unlink(stale)
        for path in sorted(glob.glob(os.path.join(glob.escape(self.data_dir), "*" + FILE_SUFFIX))):
            try:
                extent = Extent.adopt(path)
            except (OSError, ValueError) as exc:
                log.warning("not adopting %s: %s", path, exc)
                continue
            if extent.extent_id in self._extents:
                log.warning("not adopting %s: extent %d already adopted", path, extent.extent_id)
                extent.retire(keep_data=True)
                continue
            self._extents[extent.extent_id] = extent
            self._used += extent.length
            log.info("adopted persistent %r", extent)
        if self._used > self.capacity:
            log.warning("adopted extents use %d bytes, more than the capacity of %d bytes",
                        self._used, self.capacity)
