"""The rdma transport's registration cache, with a fake device (no RDMA needed)."""
from __future__ import annotations

import gc
import mmap

import numpy as np

from smb_client.transports.rdma.registration import PAGE, RegistrationCache, address_of, owner_of

WRITABLE = 1


class FakeMR:
    def __init__(self, address: int, length: int, access: int) -> None:
        self.address, self.length, self.access = address, length, access
        self.lkey = id(self) & 0xFFFFFFFF
        self.closed = False

    def close(self) -> None:
        assert not self.closed, "an MR closed twice"
        self.closed = True


class FakeDevice:
    def __init__(self, fail_writable: bool = False) -> None:
        self.mrs: list[FakeMR] = []
        self.fail_writable = fail_writable

    def create_mr(self, address: int, length: int, access: int) -> FakeMR:
        if self.fail_writable and access:
            raise OSError("read-only mapping")
        mr = FakeMR(address, length, access)
        self.mrs.append(mr)
        return mr


def span(arr: np.ndarray) -> tuple[int, int]:
    start = int(arr.ctypes.data)
    return start, start + arr.nbytes


def test_whole_owner_registered_once_page_aligned_and_reused():
    dev = FakeDevice()
    cache = RegistrationCache(dev, writable_access=WRITABLE)
    arr = np.zeros(3 * PAGE + 100, np.uint8)
    owner, start, end = owner_of(memoryview(arr[10:20]))
    assert owner is arr and (start, end) == span(arr)
    reg = cache.acquire(owner, start, end, writable=True)
    assert reg is not None and reg.start % PAGE == 0 and reg.end % PAGE == 0
    assert reg.start <= start and end <= reg.end and dev.mrs[0].access == WRITABLE
    cache.release(reg)
    again = cache.acquire(arr, start, end, writable=False)      # read-only use of a writable entry
    assert again is reg and cache.hits == 1 and cache.misses == 1 and len(dev.mrs) == 1
    cache.release(again)
    cache.close()
    assert dev.mrs[0].closed


def test_read_only_entry_is_replaced_for_a_writable_use():
    dev = FakeDevice()
    cache = RegistrationCache(dev, writable_access=WRITABLE)
    arr = np.ones(PAGE, np.uint8)
    ro = cache.acquire(arr, *span(arr), writable=False)
    cache.release(ro)
    rw = cache.acquire(arr, *span(arr), writable=True)
    assert rw is not ro and dev.mrs[0].closed and not dev.mrs[1].closed
    cache.release(rw)


def test_entry_dies_with_its_owner_but_not_while_held():
    dev = FakeDevice()
    cache = RegistrationCache(dev, writable_access=WRITABLE)
    arr = np.zeros(2 * PAGE, np.uint8)
    reg = cache.acquire(arr, *span(arr), writable=True)
    del arr
    gc.collect()
    assert len(cache) == 0 and cache.registered_bytes == 0
    assert not dev.mrs[0].closed                   # still in use by an operation
    cache.release(reg)
    assert dev.mrs[0].closed


def test_least_recently_used_evicted_beyond_the_limits():
    dev = FakeDevice()
    cache = RegistrationCache(dev, max_entries=2, writable_access=WRITABLE)
    arrays = [np.zeros(PAGE, np.uint8) for _ in range(3)]
    for a in arrays:
        cache.release(cache.acquire(a, *span(a), writable=False))
    assert len(cache) == 2 and dev.mrs[0].closed and not dev.mrs[2].closed
    small = RegistrationCache(dev, max_bytes=PAGE, writable_access=WRITABLE)
    held = small.acquire(arrays[0], *span(arrays[0]), writable=False)
    big = np.zeros(4 * PAGE, np.uint8)
    reg = small.acquire(big, *span(big), writable=False)
    assert held is not None and reg is not None and len(small) == 2   # held entries stay
    small.release(held)
    small.release(reg)


def test_owners_without_weak_references_are_not_cached():
    cache = RegistrationCache(FakeDevice(), writable_access=WRITABLE)
    data = bytearray(PAGE)
    assert owner_of(memoryview(data)) is None
    assert cache.acquire(b"bytes", 0, 5, writable=False) is None


def test_mmap_owner_and_read_only_fallback():
    mm = mmap.mmap(-1, 2 * PAGE)
    view = memoryview(mm)[100:200]
    owner, start, end = owner_of(view)
    assert owner is mm and end - start == 2 * PAGE and address_of(view) == start + 100
    dev = FakeDevice(fail_writable=True)
    cache = RegistrationCache(dev, writable_access=WRITABLE)
    assert cache.acquire(mm, start, end, writable=True) is None
    reg = cache.acquire(mm, start, end, writable=False)
    assert reg is not None and not reg.writable
    cache.release(reg)
    cache.close()
    del view
