"""A memory server restarted (kill -9, then a new process listening on a new tcp port)
is served to the clients that existed before: every data-plane session bound to an
endpoint the server no longer serves, and any session one borrows (shm's arithmetic over
tcp), is replaced by one bound to the endpoint the controller now lists."""
from __future__ import annotations

import time

import numpy as np
import pytest

from smb_protocol import errors
from smb_server.commands.local_cluster import LocalCluster

MiB = 1 << 20


def _restart(cluster: LocalCluster, client, server_id: str) -> tuple[str, ...]:
    """kill -9 the server ``server_id`` and start it again; wait until the controller
    lists it up with endpoints other than before; returns the new endpoints."""
    index = [i for i in range(cluster.num_servers) if cluster.server_id(i) == server_id][0]
    before = {s.server_id: s.endpoints for s in client.list_servers()}[server_id]
    cluster.kill_server(index)
    cluster.start_server(index)
    deadline = time.monotonic() + 30
    while True:
        now = {s.server_id: s for s in client.list_servers()}[server_id]
        if now.state == "up" and now.endpoints != before:
            return now.endpoints
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.05)


def _on(client, name: str, server_id: str, **kw):
    """A one-segment region placed on ``server_id``."""
    return client.create_region(name, MiB, placement="layered", segment_sizes=[MiB],
                                server_weights={server_id: 1.0}, **kw)


def _no_stale_sessions(client, endpoints: tuple[str, ...], old: tuple[str, ...]) -> None:
    stale = set(old) - set(endpoints)
    assert stale and not stale & set(client.open_sessions()), (client.open_sessions(), endpoints)


@pytest.mark.parametrize("transport", ["shm", "tcp", "auto"])
def test_new_region_on_a_restarted_server_works_from_an_old_client(fresh_cluster, transport):
    with fresh_cluster.client(transport=transport) as c:
        a = c.create_region("t/a", MiB, placement="single")
        assert a.fetch_add(0, 1) == 0
        a.accumulate(8, np.ones(4, np.float32))
        victim = a.extents[0].server_id
        old = a.extents[0].endpoints
        endpoints = _restart(fresh_cluster, c, victim)

        b = _on(c, "t/b", victim)     # a new region, on the restarted server: works at once
        assert b.fetch_add(0, 5) == 0
        assert b.fetch_add(0, 1) == 5
        assert b.compare_swap(0, 6, 7) == 6
        b.accumulate(8, np.full(4, 2.0, np.float32))
        b.scale(8, 16, 0.5, "float32")
        b.write(64, b"fresh!")
        assert bytes(b.read(64, 6)) == b"fresh!"
        assert b.read(8, 16, dtype="float32").tolist() == [1.0] * 4
        assert b.read(0, 8, dtype="int64").tolist() == [7]
        assert set(b.transports().values()) == ({"tcp"} if transport == "tcp" else {"shm"})
        _no_stale_sessions(c, endpoints, old)

        # the old region's memory died with the server: lost, never served from the new one
        with pytest.raises((errors.RegionLost, errors.ServerUnavailable)):
            a.fetch_add(0, 1)


@pytest.mark.parametrize("transport", ["shm", "tcp", "auto"])
def test_old_regions_of_a_restarted_persistent_server_work_again(tmp_path, transport):
    with LocalCluster(servers=2, capacity="128M", workdir=str(tmp_path / "cluster"), persistent=True,
                      log_level="INFO") as cluster, cluster.client(transport=transport) as c:
        victim = cluster.server_id(0)
        r = _on(c, "t/keep", victim, persistent=True)
        assert r.fetch_add(0, 3) == 0
        r.write(256, b"before the kill")
        old = r.extents[0].endpoints
        endpoints = _restart(cluster, c, victim)

        deadline = time.monotonic() + 30
        while True:   # the first operation may meet the dead server and learn where it went
            try:
                got = r.fetch_add(0, 1)
                break
            except errors.ServerUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert got == 3 and r.fetch_add(0, 0) == 4          # what was acknowledged survived
        assert bytes(r.read(256, 15)) == b"before the kill"
        r.accumulate(8, np.ones(4, np.float32))
        r.accumulate(8, np.ones(4, np.float32))
        assert r.read(8, 16, dtype="float32").tolist() == [2.0] * 4
        r.write(64, b"again")
        assert bytes(r.read(64, 5)) == b"again"
        assert r.compare_swap(0, 4, 100) == 4
        _no_stale_sessions(c, endpoints, old)
        assert {x.name: x.state for x in c.list_regions()}["t/keep"] == "ready"
