"""Zero-copy registrations of caller buffers, cached by the object that owns the memory.

Pure bookkeeping around one call, ``device.create_mr(address, length, access)``: the
cache works with any object that has it (tests use a fake device, no RDMA needed).
"""
from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
REG_CACHE_BYTES = 4 << 30  # registered bytes kept in the cache before evicting
REG_CACHE_ENTRIES = 1024


class Registrar(Protocol):
    """What the cache needs of a device."""

    def create_mr(self, address: int, length: int, access: int) -> Any: ...


@dataclass
class Registration:
    """One cached registration of a whole owner (page-aligned), ``[start, end)``."""

    start: int
    end: int
    mr: Any
    writable: bool
    ref: Any                      # weakref to the owner
    users: int = 0
    dead: bool = False
    last_used: float = field(default_factory=time.monotonic)


class RegistrationCache:
    """Memory registrations of caller buffers, keyed by the owning object.

    Thread-safe. An entry lives while its owner does (a weak reference tells), is
    pinned by :meth:`acquire` until :meth:`release`, and is evicted least recently
    used beyond ``max_bytes``/``max_entries``. Borrows ``device``; owns the MRs it
    made and closes them (:meth:`close`) before the device is closed.
    ``writable_access``: the access flags of a registration the device may write into
    (``IBV_ACCESS_LOCAL_WRITE``; looked up in pyverbs when not given).
    """

    def __init__(self, device: Registrar, max_bytes: int = REG_CACHE_BYTES,
                 max_entries: int = REG_CACHE_ENTRIES, writable_access: int | None = None) -> None:
        if writable_access is None:
            import pyverbs.enums as e
            writable_access = e.IBV_ACCESS_LOCAL_WRITE
        self.device = device
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._rw = writable_access
        self._lock = threading.Lock()
        self._by_owner: dict[int, Registration] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_owner)

    def acquire(self, owner: Any, start: int, end: int, writable: bool) -> Registration | None:
        """A registration covering ``[start, end)`` of ``owner`` (held until released);
        None when the owner cannot be weakly referenced or registration fails."""
        key = id(owner)
        with self._lock:
            reg = self._by_owner.get(key)
            if reg is not None:
                if (reg.ref() is owner and not reg.dead and reg.start <= start and end <= reg.end
                        and (reg.writable or not writable)):
                    reg.users += 1
                    reg.last_used = time.monotonic()
                    self.hits += 1
                    return reg
                self._drop_locked(key, reg)
            self.misses += 1
        try:
            ref = weakref.ref(owner, functools.partial(self._on_owner_died, key))
        except TypeError:
            return None
        pstart = start - start % PAGE
        pend = -(-end // PAGE) * PAGE
        try:
            mr = self.device.create_mr(pstart, pend - pstart, self._rw if writable else 0)
        except Exception as exc:
            if writable:
                log.debug("cannot register %d bytes writable: %s", pend - pstart, exc)
                return None
            try:  # some read-only mappings only register page-exact
                mr = self.device.create_mr(start, end - start, 0)
                pstart, pend = start, end
            except Exception as exc2:
                log.debug("cannot register %d bytes: %s", end - start, exc2)
                return None
        reg = Registration(pstart, pend, mr, writable, ref, users=1)
        with self._lock:
            old = self._by_owner.get(key)
            if old is not None:
                self._drop_locked(key, old)
            self._by_owner[key] = reg
            self._bytes += pend - pstart
            self._evict_locked()
        return reg

    def release(self, reg: Registration) -> None:
        with self._lock:
            reg.users -= 1
            if reg.users == 0 and reg.dead:
                reg.mr.close()

    def _on_owner_died(self, key: int, _ref: Any) -> None:
        self._owner_died(key)

    def _owner_died(self, key: int) -> None:
        with self._lock:
            reg = self._by_owner.get(key)
            if reg is not None and reg.ref() is None:
                self._drop_locked(key, reg)

    def _drop_locked(self, key: int, reg: Registration) -> None:
        if self._by_owner.get(key) is reg:
            del self._by_owner[key]
            self._bytes -= reg.end - reg.start
        if not reg.dead:
            reg.dead = True
            if reg.users == 0:
                reg.mr.close()

    def _evict_locked(self) -> None:
        if self._bytes <= self.max_bytes and len(self._by_owner) <= self.max_entries:
            return
        for key, reg in sorted(self._by_owner.items(), key=lambda kv: kv[1].last_used):
            if self._bytes <= self.max_bytes and len(self._by_owner) <= self.max_entries:
                break
            if reg.users == 0:
                self._drop_locked(key, reg)

    def close(self) -> None:
        """Deregister every idle entry now; held ones when released."""
        with self._lock:
            regs, self._by_owner = list(self._by_owner.values()), {}
            self._bytes = 0
            for reg in regs:
                if not reg.dead:
                    reg.dead = True
                    if reg.users == 0:
                        reg.mr.close()


def address_of(view: memoryview) -> int:
    """Virtual address of a non-empty buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)


def owner_of(view: memoryview) -> tuple[Any, int, int] | None:
    """(owner, start address, end address) of the memory behind ``view``, for owners
    whose lifetime says whether the memory is still theirs (numpy arrays, mmaps, torch
    storages); None otherwise."""
    obj: Any = view.obj
    while isinstance(obj, np.ndarray):
        base = obj.base
        if base is None:
            start = int(obj.ctypes.data)
            return obj, start, start + obj.nbytes
        if isinstance(base, np.ndarray):
            obj = base
            continue
        if isinstance(base, mmap.mmap):
            start = int(np.frombuffer(base, np.uint8, count=1).ctypes.data)
            return base, start, start + len(base)
        if type(base).__module__.startswith("torch"):
            storage = base.untyped_storage()
            start = int(storage.data_ptr())
            return storage, start, start + storage.nbytes()
        return None
    if isinstance(obj, mmap.mmap):
        start = int(np.frombuffer(obj, np.uint8, count=1).ctypes.data)
        return obj, start, start + len(obj)
    return None
