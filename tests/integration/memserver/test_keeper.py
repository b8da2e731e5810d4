"""The keeper of persistent extents on its own, as a real process: it holds the memfds it
is handed, gives them back to the next server, writes them back to their files when its
server goes away or when it is stopped, and lets go of released ones."""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from smb_server.memserver.arena import HEADER, HEADER_BYTES, HEADER_MAGIC
from smb_server.memserver.keeper import KeeperError
from smb_server.memserver.keeper_link import KeeperLink, close_arena, open_arena
from smb_server.testing import wait_until

WAIT = 10.0   # seconds any one condition below may take
LENGTH = 3 * 4096 + 100



def extent(data_dir, extent_id: int, data: bytes) -> tuple[int, str]:
    """A memfd holding ``data`` (after the header page), and its file as a new server
    makes it (zeros)."""
    fd = os.memfd_create(f"test-{extent_id}", os.MFD_CLOEXEC)
    os.ftruncate(fd, HEADER_BYTES + LENGTH)
    with mmap.mmap(fd, HEADER_BYTES + LENGTH) as mm:
        HEADER.pack_into(mm, 0, HEADER_MAGIC, 1, extent_id, LENGTH, b"uid-%d" % extent_id)
        mm[HEADER_BYTES:HEADER_BYTES + len(data)] = data
    path = str(data_dir / f"{extent_id}.extent")
    with open(path, "wb") as f:
        f.truncate(HEADER_BYTES + LENGTH)
    return fd, path


def contents(fd_or_path: int | str) -> bytes:
    if isinstance(fd_or_path, str):
        with open(fd_or_path, "rb") as f:
            return f.read()[HEADER_BYTES:]
    with mmap.mmap(fd_or_path, HEADER_BYTES + LENGTH, prot=mmap.PROT_READ) as mm:
        return bytes(mm[HEADER_BYTES:])


def keeper_pid(link: KeeperLink) -> int:
    assert link._proc is not None
    return link._proc.pid


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir(mode=0o700)
    return d


def test_memfds_outlive_their_server_and_are_written_back(data_dir):
    link = KeeperLink(str(data_dir))
    pid = keeper_pid(link)
    try:
        fd, path = extent(data_dir, 7, b"")
        link.keep(7, LENGTH, "uid-7", path, fd)
        with mmap.mmap(fd, HEADER_BYTES + LENGTH) as mm:   # written after the hand-over
            mm[HEADER_BYTES + 4000:HEADER_BYTES + 4005] = b"after"
        os.close(fd)                    # the server's own descriptor goes (kill -9)
        link.close()
        expected = bytes(4000) + b"after" + bytes(LENGTH - 4005)
        wait_until(lambda: contents(path) == expected, "the keeper to write the extent back", WAIT)
        with open(path, "rb") as f:
            magic, live, extent_id, length, uid = HEADER.unpack(f.read(HEADER.size))
        assert (magic, live, extent_id, length) == (HEADER_MAGIC, 1, 7, LENGTH)
        assert uid.rstrip(b"\0") == b"uid-7"
        # the next server takes the memory back: the same pages
        again = KeeperLink(str(data_dir))
        assert again._proc is None                  # the running keeper, not a new one
        taken = again.take()
        assert list(taken) == [7]
        fd2, length, uid = taken[7]
        assert (length, uid) == (LENGTH, "uid-7") and contents(fd2) == expected
        with mmap.mmap(fd2, HEADER_BYTES + LENGTH) as mm:
            mm[HEADER_BYTES:HEADER_BYTES + 3] = b"new"
        os.close(fd2)
        assert contents(again.take()[7][0])[:3] == b"new"
        again.quit()
    finally:
        link.quit()
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), "the keeper to exit", WAIT)
    assert not (data_dir / "keeper.sock").exists()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_released_extents_are_dropped(data_dir):
    link = KeeperLink(str(data_dir))
    try:
        for i in (1, 2, 3):
            fd, path = extent(data_dir, i, b"x%d" % i)
            link.keep(i, LENGTH, f"uid-{i}", path, fd)
            os.close(fd)
        link.drop(2)
        os.unlink(data_dir / "3.extent")         # released, its file deleted before the drop
        taken = link.take()
        assert sorted(taken) == [1, 3]
        for fd, _length, _uid in taken.values():
            os.close(fd)
        link.close()                             # the keeper writes back and forgets 3
        again = KeeperLink(str(data_dir))
        taken = again.take()
        assert sorted(taken) == [1]
        assert contents(taken[1][0])[:2] == b"x1"
        os.close(taken[1][0])
        again.quit()
    finally:
        link.quit()


def test_sigterm_writes_everything_back_then_exits(data_dir):
    link = KeeperLink(str(data_dir))
    pid = keeper_pid(link)
    fd, path = extent(data_dir, 4, b"sigterm")
    link.keep(4, LENGTH, "uid-4", path, fd)
    os.close(fd)
    os.kill(pid, signal.SIGTERM)
    assert link._proc is not None and link._proc.wait(WAIT) == 0
    assert contents(path)[:7] == b"sigterm"
    with pytest.raises(KeeperError):
        link.drop(4)
    link.connect()                               # a new keeper, holding nothing
    assert link.take() == {}
    link.quit()


def test_a_keeper_refuses_a_file_outside_its_directory(data_dir, tmp_path):
    link = KeeperLink(str(data_dir))
    try:
        fd, _path = extent(data_dir, 5, b"")
        with pytest.raises(KeeperError, match="is not in"):
            link.keep(5, LENGTH, "uid-5", str(tmp_path / "elsewhere.extent"), fd)
        os.close(fd)
        assert link.ping()
    finally:
        link.quit()


def test_the_keeper_runs_as_a_module(data_dir):
    out = subprocess.run([sys.executable, "-m", "smb_server.memserver.keeper", "--help"],
                         capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0 and "data_dir" in out.stdout


def test_a_second_server_on_the_same_data_dir_is_refused_clearly(data_dir):
    first = KeeperLink(str(data_dir))
    try:
        second = KeeperLink(str(data_dir))
        with pytest.raises(KeeperError, match="already; give each memory server a data_dir"):
            second.sync()
        second.close()
        assert first.ping()                       # the first one is still served
    finally:
        first.quit()


def test_an_arena_opened_after_a_crash_adopts_what_the_keeper_wrote_back(data_dir):
    arena, keeper = open_arena(16 << 20, str(data_dir), writeback_seconds=0)
    assert keeper is not None
    extent = arena.reserve(1, "uid-1", 1 << 20, persistent=True)
    extent.array("int64")[:] = np.arange((1 << 20) // 8)
    keeper.stopping()                             # as if the server died: the connection goes,
    keeper.link.close()                           # its memory stays with the keeper
    again, keeper2 = open_arena(16 << 20, str(data_dir), writeback_seconds=0)
    try:
        assert keeper2 is not None and keeper2.link._proc is None   # the same keeper
        np.testing.assert_array_equal(again.get(1).array("int64"), np.arange((1 << 20) // 8))
        taken = keeper2.link.take()
        assert sorted(taken) == [1]
        for fd, _length, _uid in taken.values():
            os.close(fd)
    finally:
        close_arena(again, keeper2)
        arena.close()


def test_attaching_an_arena_drops_what_it_did_not_adopt(data_dir):
    link = KeeperLink(str(data_dir))
    fd, _path = extent(data_dir, 9, b"stale")     # 9.extent: zeros, no valid header
    odd = str(data_dir / "x9.extent")             # a file the arena will not adopt
    open(odd, "wb").close()
    link.keep(9, LENGTH, "uid-9", odd, fd)
    os.close(fd)
    link.close()
    arena, keeper = open_arena(16 << 20, str(data_dir), writeback_seconds=0)
    try:
        assert keeper is not None and len(arena) == 0
        assert keeper.link.take() == {}
    finally:
        close_arena(arena, keeper)
