"""An evacuation survives a leader kill on the etcd store: the drain flag is in etcd, so
the controller that takes over moves what is left (and finishes a move whose copy was in
step), with real controller and memory-server processes and a real etcd."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from smb_client import Client
from smb_server.runtime.credentials import admin_credential
from smb_server.testing import ControllerGroup, EtcdServer

MiB = 1 << 20
SETTLE = 120.0


@pytest.fixture
def group(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[ControllerGroup]:
    with ControllerGroup(tmp_path, etcd_server.url(), count=2, leader_lease=2) as g:
        for _ in range(3):
            g.start_server()
        yield g


def test_a_new_leader_finishes_an_evacuation_the_old_one_began(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    admin_token = admin_credential(bytes.fromhex(group.secret_file.read_text().strip()))
    with group.client(reconnect_timeout=30.0) as c, \
            Client(",".join(group.addresses), admin_token, reconnect_timeout=30.0) as admin:
        region = c.create_region("job/params", 24 * MiB, stripe_unit=MiB, num_servers=2)
        data = np.random.default_rng(3).integers(0, 1 << 60, 24 * MiB // 8, dtype=np.int64)
        region.write(0, data)
        source = region.route.extents[0].server_id
        admin.drain_server(source, evacuate=True)
        group.kill(leader)                       # at once: the move is under way or not begun
        deadline = time.monotonic() + SETTLE
        while next(s for s in admin.list_servers() if s.server_id == source).extents:
            assert time.monotonic() < deadline, "the new leader did not finish the evacuation"
            time.sleep(0.1)
        assert group.wait_leader(among=(1 - leader,)) == 1 - leader
        region.refresh()
        assert source not in {p.server_id for p in region.route.extents}
        np.testing.assert_array_equal(region.read(0, dtype=np.int64), data)
        assert {r.name: r.state for r in c.list_regions()}["job/params"] == "ready"
