"""A region handle is bound to one incarnation of its region (its uid): once the region
is deleted and another is created under the same name, every operation of the old
handle raises RegionNotFound, over every transport, replicated or not, and the new
region is never touched."""
from __future__ import annotations

import numpy as np
import pytest

from smb_client import Barrier, Collective, Lock
from smb_protocol import errors

OPS = {
    "write": lambda r: r.write(0, b"bad!"),
    "read": lambda r: r.read(0, 4),
    "accumulate": lambda r: r.accumulate(64, np.ones(4, np.float32)),
    "axpy": lambda r: r.axpy(64, np.ones(4, np.float32), 2.0),
    "scale": lambda r: r.scale(64, 16, 3.0, "float32"),
    "fetch_add": lambda r: r.fetch_add(8, 1),
    "compare_swap": lambda r: r.compare_swap(8, 0, 5),
    "write_many": lambda r: r.write_many([(0, b"bad!"), (128, b"bad!")]),
    "read_many": lambda r: r.read_many([(0, bytearray(4))]),
    "fetch_add_many": lambda r: r.fetch_add_many([(8, 1), (16, 1)]),
    "accumulate_many": lambda r: r.accumulate_many([(64, np.ones(4, np.float32))]),
    "write_async": lambda r: r.write_async(0, b"bad!").result(30),
    "wait": lambda r: r.wait(8, value=1, timeout=1.0),
    "lock": lambda r: Lock(r, 24, timeout=1.0).acquire(),
    "barrier": lambda r: Barrier(r, 32, 1).wait(timeout=1.0),
    "refresh": lambda r: r.refresh(),
}


def _recreated(c, name, replicas):
    old = c.create_region(name, 4096, placement="single", replicas=replicas)
    old.write(0, b"old!")
    c.delete_region(name)
    new = c.create_region(name, 4096, placement="single", replicas=replicas)
    new.write(0, b"new!")
    return old, new


def _untouched(new) -> None:
    assert bytes(new.read(0, 4)) == b"new!"
    assert bytes(new.read(128, 4)) == b"\0" * 4
    assert new.read(8, 32, dtype="int64").tolist() == [0, 0, 0, 0]
    assert new.read(64, 16, dtype="float32").tolist() == [0.0] * 4


@pytest.mark.parametrize("replicas", [1, 2], ids=["single", "replicated"])
@pytest.mark.parametrize("transport", ["tcp", "shm", "auto"])
@pytest.mark.parametrize("first", ["write", "read", "fetch_add", "wait"])
def test_an_old_handle_never_reaches_the_new_region_of_its_name(cluster, name, transport, replicas, first):
    with cluster.client(transport=transport) as c:
        old, new = _recreated(c, name, replicas)
        for op in [first, *(k for k in OPS if k != first)]:
            with pytest.raises(errors.RegionNotFound):
                OPS[op](old)
        _untouched(new)
        assert new.uid != old.uid
        c.delete_region(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_an_old_handle_whose_ticket_expires_never_adopts_the_new_region(cluster, name, transport):
    with cluster.client(transport=transport) as c:
        old, new = _recreated(c, name, 1)
        old.route.expires_at = 0.0       # the next operation renews its ticket first
        for op in ("write", "fetch_add", "read"):
            with pytest.raises(errors.RegionNotFound):
                OPS[op](old)
        _untouched(new)
        c.delete_region(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_an_old_collective_never_reaches_the_new_one(cluster, name, transport):
    with cluster.client(transport=transport) as c:
        old = Collective.create(c, name, 1 << 16, parties=1, timeout=10)
        assert old.all_reduce(np.ones(1 << 14, np.float32)).tolist() == [1.0] * (1 << 14)
        c.delete_region(name)
        new = Collective.create(c, name, 1 << 16, parties=1, timeout=10)
        for _ in range(2):
            with pytest.raises(errors.RegionNotFound):
                old.all_reduce(np.full(1 << 14, 7, np.float32))
            with pytest.raises(errors.RegionNotFound):
                old.broadcast(np.full(1 << 14, 7, np.float32), root=0, rank=0)
        data = np.arange(1 << 14, dtype=np.float32)
        assert np.array_equal(new.all_reduce(data.copy()), data)   # its rounds start where they should
        old.close()
        new.destroy()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_an_old_handle_of_a_deleted_region_whose_server_died_says_not_found(fresh_cluster, transport):
    """The region was deleted, then its server died: the controller knows it is gone, so
    the handle says RegionNotFound (not ServerUnavailable, which invites retries), at
    once and for every later operation. (Found by the soak, bench/soak.py.)"""
    with fresh_cluster.client(transport=transport) as c:
        old = c.create_region("t/deleted", 4096, placement="single")
        old.write(0, b"old!")
        victim = old.extents[0].server_id
        c.delete_region("t/deleted")
        fresh_cluster.kill_server([i for i in range(2) if fresh_cluster.server_id(i) == victim][0])
        for op in ("write", "fetch_add", "read", "accumulate"):
            with pytest.raises(errors.RegionNotFound):
                OPS[op](old)
