"""The memory server's arena: budget, extents, release semantics, persistence."""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from smb_protocol.errors import ExtentNotFound, InvalidArgument, OutOfMemory, OutOfRange
from smb_server.memserver.arena import HEADER, HEADER_BYTES, HEADER_MAGIC, LIVE_OFFSET, Arena
from smb_server.memserver.extent import Extent
from smb_server.memserver.memmap import data_ranges, punch_hole

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def arena():
    a = Arena(16 * MiB)
    yield a
    a.close()


def test_reserve_release_accounting(arena):
    e = arena.reserve(1, "uid-a", 4096)
    assert (arena.used, arena.capacity, len(arena)) == (4096, 16 * MiB, 1)
    assert bytes(e.data[:16]) == bytes(16)                 # fresh memory reads zeros
    assert arena.reserve(1, "uid-a", 4096) is e            # idempotent
    arena.reserve(2, "uid-a", MiB)
    assert arena.used == 4096 + MiB
    held = {h.extent_id: h for h in arena.held()}
    assert held[2].region_uid == "uid-a" and held[2].length == MiB and held[2].age_seconds >= 0
    assert arena.get(1) is e
    assert arena.release(1) is True
    assert arena.release(1) is False
    assert arena.used == MiB
    with pytest.raises(ExtentNotFound):
        arena.get(1)


def test_reserve_rejects_bad_requests(arena):
    with pytest.raises(InvalidArgument):
        arena.reserve(1, "uid", 0)
    arena.reserve(1, "uid", 4096)
    with pytest.raises(InvalidArgument, match="already held"):
        arena.reserve(1, "other-uid", 4096)
    with pytest.raises(InvalidArgument, match="already held"):
        arena.reserve(1, "uid", 8192)


def test_out_of_memory_names_the_numbers(arena):
    arena.reserve(1, "uid", 10 * MiB)
    with pytest.raises(OutOfMemory) as info:
        arena.reserve(2, "uid", 8 * MiB)
    text = str(info.value)
    for number in ("8.0 MiB", "10.0 MiB", "16.0 MiB", "6.0 MiB"):    # in readable units
        assert number in text
    assert arena.used == 10 * MiB               # a failed reservation claims nothing
    arena.reserve(2, "uid", 6 * MiB)             # exactly fills the budget


def test_header_layout_and_live_word(arena):
    e = arena.reserve(77, "region-uid-1", 8192)
    header = os.pread(e.fd, HEADER.size, 0)
    magic, live, extent_id, length, uid = HEADER.unpack(header)
    assert (magic, live, extent_id, length) == (HEADER_MAGIC, 1, 77, 8192)
    assert uid.rstrip(b"\0") == b"region-uid-1"
    # a client maps the whole descriptor, header included
    fd = os.dup(e.fd)
    client = mmap.mmap(fd, HEADER_BYTES + 8192, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    e.data[:4] = b"abcd"
    assert client[HEADER_BYTES:HEADER_BYTES + 4] == b"abcd"
    assert struct.unpack_from("<Q", client, LIVE_OFFSET)[0] == 1
    arena.release(77)
    assert struct.unpack_from("<Q", client, LIVE_OFFSET)[0] == 0
    assert client[HEADER_BYTES:HEADER_BYTES + 4] == bytes(4)   # punched out: zeros, never stale data
    client.close()


def test_array_views_and_bounds(arena):
    e = arena.reserve(3, "uid", 4096)
    a = e.array(np.float32, 16, 64)
    a[:] = 1.5
    assert np.frombuffer(e.data[16:80], np.float32).tolist() == [1.5] * 16
    del a
    with pytest.raises(OutOfRange):
        e.array(np.float32, 4000, 200)


def test_descriptor_cannot_be_shrunk(arena):
    e = arena.reserve(4, "uid", 4096)
    with pytest.raises(PermissionError):
        os.ftruncate(e.fd, 10)       # sealed: a client cannot pull memory from under the server


def test_release_returns_memory_even_while_a_client_maps_it():
    arena = Arena(128 * MiB)
    try:
        size = 64 * MiB
        e = arena.reserve(9, "uid", size)
        fd = os.dup(e.fd)
        client = mmap.mmap(fd, HEADER_BYTES + size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        before = rss()
        np.frombuffer(e.data, np.uint8).fill(1)       # touch every page (no temporaries)
        assert client[HEADER_BYTES + size - 1] == 1
        touched = rss()
        assert touched - before > 48 * MiB
        arena.release(9)
        after = rss()
        assert touched - after > 48 * MiB, (before, touched, after)
        assert client[HEADER_BYTES + size - 1] == 0
        client.close()
    finally:
        arena.close()


def test_release_while_pinned_defers_unmap(arena):
    e = arena.reserve(5, "uid", 4096)
    with e.pin():
        arena.release(5)
        assert not e.live
        e.data[:2] = b"ok"          # the mapping stays valid for the pinned operation
        with pytest.raises(ExtentNotFound):
            with e.pin():
                pass
    assert e._mm.closed


def test_unmapped_after_release(arena):
    e = arena.reserve(6, "uid", 4096)
    arena.release(6)
    assert e._mm.closed
    with pytest.raises(OSError):
        os.fstat(e.fd)


def test_file_backed_extents_survive_a_restart(tmp_path):
    data_dir = str(tmp_path / "data")
    arena = Arena(16 * MiB, data_dir)
    e = arena.reserve(11, "uid-p", 8192, persistent=True)
    e.data[100:105] = b"hello"
    arena.reserve(12, "uid-m", 4096)                  # memory only: gone after restart
    assert os.path.exists(os.path.join(data_dir, "11.extent"))
    arena.close()
    assert os.path.exists(os.path.join(data_dir, "11.extent"))

    arena = Arena(16 * MiB, data_dir)
    try:
        assert arena.used == 8192 and len(arena) == 1
        e = arena.get(11)
        assert (e.region_uid, e.length, e.persistent) == ("uid-p", 8192, True)
        assert bytes(e.data[100:105]) == b"hello"
        assert os.pread(e.fd, 8, LIVE_OFFSET) == struct.pack("<Q", 1)
        with pytest.raises(ExtentNotFound):
            arena.get(12)
        assert arena.release(11)
        assert not os.path.exists(os.path.join(data_dir, "11.extent"))
    finally:
        arena.close()


def test_adoption_skips_damaged_files(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "5.extent").write_bytes(b"garbage" * 1000)
    (data_dir / "6.extent.new").write_bytes(b"half-made")
    arena = Arena(MiB, str(data_dir))
    try:
        assert len(arena) == 0 and arena.used == 0
        assert not (data_dir / "6.extent.new").exists()
    finally:
        arena.close()


def test_persistent_without_data_dir_uses_memory(arena):
    e = arena.reserve(8, "uid", 4096, persistent=True)
    assert e.path == "" and not e.persistent


def _file_bytes(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize("persistent", [False, True], ids=["memory", "file-backed"])
def test_every_extent_is_a_sealed_private_memfd(tmp_path, persistent):
    arena = Arena(16 * MiB, str(tmp_path / "data"), writeback_seconds=0)
    try:
        e = arena.reserve(21, "uid", 8192, persistent=persistent)
        assert e.persistent is persistent
        assert os.readlink(f"/proc/self/fd/{e.fd}").startswith("/memfd:")   # never the file
        assert os.fstat(e.fd).st_mode & 0o777 == 0o600
        seals = fcntl.fcntl(e.fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want
        fd = os.open(f"/proc/self/fd/{e.fd}", os.O_RDWR)   # what a same-user client could do
        try:
            for size in (10, HEADER_BYTES + 8192 + 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(fd)
        e.data[8191] = 5                                   # the server's mapping still works
    finally:
        arena.close()


def test_file_backed_extent_is_written_back_and_adopted_sparse(tmp_path):
    data_dir = str(tmp_path / "data")
    arena = Arena(256 * MiB, data_dir, writeback_seconds=0)
    e = arena.reserve(31, "uid-w", 64 * MiB, persistent=True)
    path = os.path.join(data_dir, "31.extent")
    assert os.stat(path).st_size == HEADER_BYTES + 64 * MiB
    e.data[MiB:MiB + 3] = b"one"
    assert arena.write_back() == 4096                     # one page holds data
    e.data[MiB:MiB + 3] = b"two"                          # after the last write-back
    struct.pack_into("<Q", e._header, 0, 0)               # a rw client scribbling on the header
    # a crash now (no close): a new server adopts what was last written back
    crashed = Arena(256 * MiB, data_dir, writeback_seconds=0)
    try:
        back = crashed.get(31)
        assert bytes(back.data[MiB:MiB + 3]) == b"one"
        assert os.stat(path).st_blocks * 512 < MiB        # holes stay holes on disk
        assert data_ranges(back.fd, HEADER_BYTES, HEADER_BYTES + 64 * MiB) == [(HEADER_BYTES + MiB, 4096)]
    finally:
        crashed.close()
    arena.close()                                         # a clean stop writes back all of it
    again = Arena(256 * MiB, data_dir, writeback_seconds=0)
    try:
        assert bytes(again.get(31).data[MiB:MiB + 3]) == b"two"   # header from the server, not the page
    finally:
        again.close()


@contextmanager
def persistent_extent(tmp_path, extent_id: int, length: int,
                      writeback_seconds: float) -> Iterator[tuple[Arena, Extent, str]]:
    """A 16 MiB arena that writes back to a data directory in ``tmp_path`` every
    ``writeback_seconds``, holding persistent extent ``extent_id`` of ``length`` bytes:
    the arena, the extent and the extent's file. The arena is closed afterwards."""
    data_dir = str(tmp_path / "data")
    arena = Arena(16 * MiB, data_dir, writeback_seconds=writeback_seconds)
    try:
        e = arena.reserve(extent_id, "uid", length, persistent=True)
        yield arena, e, os.path.join(data_dir, f"{extent_id}.extent")
    finally:
        arena.close()


def test_write_back_runs_on_its_interval(tmp_path):
    with persistent_extent(tmp_path, 41, 8192, writeback_seconds=0.05) as (arena, e, path):
        e.data[:5] = b"later"
        deadline = time.monotonic() + 10
        while _file_bytes(path, HEADER_BYTES, 5) != b"later":
            assert time.monotonic() < deadline, "never written back"
            time.sleep(0.02)
        arena.release(41)          # a deleted region's file goes (after a write-back under way)
        while os.path.exists(path):
            assert time.monotonic() < deadline, "file never removed"
            time.sleep(0.02)
        time.sleep(0.2)                                   # and no later write-back brings it back
        assert not os.path.exists(path)


def test_write_back_turns_memory_holes_into_zeros_in_the_file(tmp_path):
    with persistent_extent(tmp_path, 51, 2 * MiB, writeback_seconds=0) as (arena, e, path):
        np.frombuffer(e.data, np.uint8)[:] = 9
        arena.write_back()
        assert _file_bytes(path, HEADER_BYTES + MiB, 4) == b"\x09" * 4
        punch_hole(e.fd, HEADER_BYTES + MiB, MiB)          # what a rw client may do
        arena.write_back()
        assert _file_bytes(path, HEADER_BYTES + MiB, 4) == bytes(4)
        assert _file_bytes(path, HEADER_BYTES, 4) == b"\x09" * 4
        assert data_ranges(os.open(path, os.O_RDONLY), HEADER_BYTES + MiB, HEADER_BYTES + 2 * MiB) == []
