"""Owner leases: a region created with ``lease=`` lives while its creator renews it, and
the controller deletes it once the creator is gone (killed with SIGKILL, or closed)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from smb_protocol import errors

OWNER_SCRIPT = """
import sys, time, smb_client
c = smb_client.connect()
c.create_region(sys.argv[1], 1 << 20, lease=1.5)
print("ready", flush=True)
time.sleep(600)
"""


def _names(cluster, prefix: str) -> list[str]:
    with cluster.client() as c:
        return [r.name for r in c.list_regions(prefix)]


def _gone_within(cluster, name: str, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if name not in _names(cluster, name):
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"region {name} still there {seconds} s later")


def test_a_killed_owners_region_is_deleted_after_its_lease(cluster, name):
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, name], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        time.sleep(3.0)                                  # twice the lease: the owner renews it
        assert _names(cluster, name) == [name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        took = _gone_within(cluster, name, 20.0)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took > 0.5                                     # the lease ran out first (1.5 s after the last renewal)


def test_a_live_owner_keeps_its_regions_and_close_lets_them_go(cluster, name):
    with cluster.client() as keeper:
        plain = keeper.create_region(f"{name}-plain", 1 << 20)        # no lease: stays
        with cluster.client() as owner:
            owner.create_region(name, 1 << 20, lease=1.0).write(0, b"kept")
            time.sleep(3.0)
            region = keeper.open_region(name)
            assert bytes(region.read(0, 4)) == b"kept"
        _gone_within(cluster, name, 20.0)
        with pytest.raises(errors.RegionNotFound):
            keeper.open_region(name)
        assert _names(cluster, plain.name) == [plain.name]
        keeper.delete_region(plain.name)


def test_a_lease_must_be_positive(cluster, name):
    with cluster.client() as c:
        for bad in (0, -1, 1e9, "5"):
            with pytest.raises(errors.InvalidArgument, match="lease"):
                c.create_region(name, 1 << 20, lease=bad)
        assert _names(cluster, name) == []


def test_a_parameter_store_with_a_lease_goes_with_its_creator(cluster, name):
    torch = pytest.importorskip("torch")
    from smb_client.torch import ParameterStore
    model = torch.nn.Linear(8, 4)
    with cluster.client() as owner:
        store = ParameterStore.create(owner, name, model, lease=1.0)
        kinds = sorted(store.regions)
        assert len(_names(cluster, f"{name}/")) == len(kinds) >= 3
    deadline = time.monotonic() + 20
    while _names(cluster, f"{name}/") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _names(cluster, f"{name}/") == []
