"""A region whose memory server came back without its memory is ``lost``: listed so,
refused with RegionLost when opened, shown by `smb status` and /metrics, deletable."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from smb_protocol import errors
from tests.integration.daemons import scrape, start_server, wait_state

MiB = 1 << 20


def _index(cluster, server_id: str) -> int:
    return [i for i in range(2) if cluster.server_id(i) == server_id][0]


def test_region_on_a_server_restarted_without_memory_is_lost(fresh_cluster):
    c = fresh_cluster.client(transport="shm")
    try:
        r = c.create_region("job/lost", 4 * MiB, stripe_unit=MiB)
        r.write(0, np.ones(MiB, np.float32))
        other = c.create_region("job/other", 2 * MiB, placement="single")
        victim = r.extents[0].server_id
        index = _index(fresh_cluster, victim)
        fresh_cluster.kill_server(index)                          # kill -9
        fresh_cluster.start_server(index)                         # fresh memory, same id
        wait_state(c, "job/lost", "lost")

        with pytest.raises(errors.RegionLost) as info:
            c.open_region("job/lost")
        assert victim in str(info.value)
        # the handle opened before: a typed refusal, never success nor ExtentNotFound
        for op in (lambda: r.read(0, 16), lambda: r.write(0, np.zeros(4, np.float32))):
            with pytest.raises(errors.SMBError) as info:
                op()
            assert isinstance(info.value, (errors.RegionLost, errors.ServerUnavailable)), info.value

        env = dict(os.environ, SMB_CONTROLLER=fresh_cluster.address, SMB_TOKEN=fresh_cluster.token)
        out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "status"], capture_output=True,
                             text=True, timeout=60, env=env)
        assert "job/lost" in out.stdout and "lost" in out.stdout.split("job/lost", 1)[1].splitlines()[0]

        c.delete_region("job/lost")
        assert "job/lost" not in {x.name for x in c.list_regions()}
        if victim not in {e.server_id for e in other.extents}:
            assert {x.name: x.state for x in c.list_regions()}["job/other"] == "ready"
        other.close()
    finally:
        c.close()


def test_lost_region_in_controller_metrics(tmp_path, cluster_env):
    env, daemons, ctl_metrics = cluster_env
    server = start_server(tmp_path, env, daemons, "s0", "--capacity", "64M", "--transports", "tcp")
    server_id = server.wait_ready()["server_id"]
    import smb_client
    with smb_client.connect(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport="tcp") as c:
        c.create_region("ops/lost", 2 * MiB).close()
        server.stop(signal.SIGKILL)
        again = start_server(tmp_path, env, daemons, "s0", "--capacity", "64M", "--transports", "tcp")
        assert again.wait_ready()["server_id"] == server_id
        wait_state(c, "ops/lost", "lost")
        ctl = scrape(ctl_metrics)
        assert ctl[("smb_controller_regions", (("state", "lost"),))] == 1
        assert ctl[("smb_controller_lost_extents", (("server_id", server_id),))] == 1
        c.delete_region("ops/lost")
        assert scrape(ctl_metrics)[("smb_controller_regions", (("state", "lost"),))] == 0


def test_tcp_handle_opened_before_the_loss_raises_region_lost(fresh_cluster):
    """A tcp handle whose server came back empty gets RegionLost naming the server, not
    the server's ExtentNotFound (which reads as if the region had been deleted)."""
    c = fresh_cluster.client(transport="tcp")
    try:
        r = c.create_region("job/lost-tcp", 2 * MiB, placement="single")
        r.write(0, np.ones(1024, np.float32))
        victim = r.extents[0].server_id
        index = _index(fresh_cluster, victim)
        fresh_cluster.kill_server(index)
        fresh_cluster.start_server(index)
        wait_state(c, "job/lost-tcp", "lost")
        ops = (lambda: r.read(0, 16), lambda: r.write(0, np.zeros(4, np.float32)),
               lambda: r.accumulate(0, np.ones(4, np.float32)), lambda: r.fetch_add(0, 1))
        for op in ops:
            deadline = time.monotonic() + 20
            while True:   # the restarted server may still be opening its listeners
                try:
                    op()
                except errors.ServerUnavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
                    continue
                except errors.SMBError as exc:
                    assert type(exc) is errors.RegionLost, repr(exc)
                    assert victim in str(exc)
                    break
                raise AssertionError("an operation on a lost region reported success")
    finally:
        c.close()
