"""Memory below the arena: mappings that keep no descriptor, hole punching, and the
process's descriptor budget (``RLIMIT_NOFILE``). Thin wrappers over libc (``mmap``,
``munmap``, ``msync``, ``fallocate``) through ctypes, because :mod:`mmap` keeps a
duplicate descriptor per mapping and offers no hole punching.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource
import weakref

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MS_SYNC = 4

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int64]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_msync = _libc.msync
_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_msync.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def raise_fd_limit() -> tuple[int, int]:
    """Lift this process's ``RLIMIT_NOFILE`` soft limit to its hard limit (each extent
    and each connection takes a descriptor); returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def open_fds() -> int:
    """Descriptors this process has open; raises OSError (EMFILE) when it has no free one
    to count them with."""
    return len(os.listdir("/proc/self/fd")) - 1   # less the one listdir used


class Mapping:
    """A shared read-write mapping of ``size`` bytes of a descriptor that keeps no
    descriptor of its own (:class:`mmap.mmap` keeps a duplicate). ``view`` is a writable
    byte memoryview of it; the pages are unmapped once the last view is gone.
    """

    def __init__(self, fd: int, size: int) -> None:
        addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
        self.address = int(addr)
        self.size = size
        pages = (ctypes.c_ubyte * size).from_address(self.address)
        weakref.finalize(pages, _munmap, self.address, size)
        self.view: memoryview | None = memoryview(pages).cast("B")

    def flush(self) -> None:
        """Write dirty pages back to the file (msync)."""
        if self.view is not None and _msync(self.address, self.size, MS_SYNC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` dropped this object's view."""
        return self.view is None

    def close(self) -> None:
        """Drop this object's view; the pages go when no other view is left."""
        if self.view is not None:
            self.view.release()
            self.view = None


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the pages of ``[offset, offset+length)`` of ``fd`` back to the kernel.

    The file keeps its size; later reads see zeros. Returns False when the file system
    does not support it.
    """
    if length <= 0:
        return True
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        log.debug("fallocate(PUNCH_HOLE) on fd %d failed: %s", fd, os.strerror(err))
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, os.strerror(err))
    return True


def data_ranges(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the parts of ``[start, end)`` of ``fd`` that hold data, as
    ``lseek(SEEK_DATA/SEEK_HOLE)`` sees them (page granularity); holes read as zeros.
    A file system without hole reporting gives the whole range."""
    out: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:      # nothing but a hole up to the end
                break
            if exc.errno == errno.EINVAL:     # no hole reporting
                return [(start, end - start)]
            raise
        if data >= end:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        out.append((data, hole - data))
        pos = hole
    return out
