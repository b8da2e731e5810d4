"""The shared-memory data plane notices its memory server's death: after kill -9 no
read or write through a mapping reports success, also once the server restarted
(then the region is lost, and says so)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from smb_protocol import errors

MiB = 1 << 20


def _index(cluster, server_id: str) -> int:
    return [i for i in range(2) if cluster.server_id(i) == server_id][0]


def _assert_refused(r, off: int) -> None:
    start = time.monotonic()
    with pytest.raises(errors.ServerUnavailable):
        r.read(off, 16)
    with pytest.raises(errors.ServerUnavailable):
        r.write(off, np.zeros(4, np.float32))
    assert time.monotonic() - start < 1.0


def test_shm_refuses_a_killed_server_and_its_restart(fresh_cluster):
    c = fresh_cluster.client(transport="shm")
    try:
        r = c.create_region("shm/live", 4 * MiB, stripe_unit=MiB)
        assert set(r.transports().values()) == {"shm"}
        r.write(0, np.ones(MiB, np.float32))
        victim = r.extents[0].server_id
        index = _index(fresh_cluster, victim)
        fresh_cluster.kill_server(index)                     # kill -9
        _assert_refused(r, 0)                                # stripe 0 lives on extent 0
        # bytes on the surviving server still work
        assert r.read(MiB, 16, dtype="float32").tolist() == [1.0] * 4

        fresh_cluster.start_server(index)                    # same socket path, new process
        # the restarted server holds nothing: every operation is refused, and once the
        # server has registered (the controller then knows its extents are gone) the
        # refusal is RegionLost
        refusals = (errors.ServerUnavailable, errors.RegionLost, errors.ExtentNotFound)
        deadline = time.monotonic() + 20
        while True:
            with pytest.raises(refusals) as info:
                r.read(0, 16)
            with pytest.raises(refusals):
                r.write(0, np.zeros(4, np.float32))
            if type(info.value) is errors.RegionLost:
                break
            assert time.monotonic() < deadline, info.value
            time.sleep(0.1)
        # a region made on the restarted server is served again through shm
        deadline = time.monotonic() + 20
        while {s.server_id: s.state for s in c.list_servers()}[victim] != "up":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fresh = c.create_region("shm/after", 2 * MiB, stripe_unit=MiB)
        fresh.write(0, np.full(2 * MiB // 4, 3, np.int32))
        assert fresh.read(0, 2 * MiB, dtype="int32").tolist() == [3] * (2 * MiB // 4)
        fresh.close()
        r.close()
    finally:
        c.close()
