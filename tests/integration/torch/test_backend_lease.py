"""The smb backend's regions go with rank 0's process: a program that ends without
``destroy_process_group()`` leaves nothing behind once the lease ran out (a real
process on a real local cluster)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from smb_server.testing import wait_until
from tests.integration.daemons import free_port

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import smb_client.torch.backend as backend

    backend.LEASE = 1.0
    dist.init_process_group("smb", init_method=sys.argv[1], rank=0, world_size=1)
    t = torch.ones(8)
    dist.all_reduce(t)
    prefix = dist.distributed_c10d._get_default_group().prefix
    import smb_client
    with smb_client.connect() as c:
        print(len(c.list_regions(prefix + "/")), prefix, flush=True)
    os._exit(0)                                  # no destroy_process_group, no cleanup at all
""")


def test_regions_of_a_group_never_destroyed_go_with_the_process(cluster, client):
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, f"tcp://127.0.0.1:{free_port()}"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    made, prefix = proc.stdout.strip().splitlines()[-1].split()
    assert int(made) == 1 and prefix.startswith("torch/")      # the all-reduce's collective
    wait_until(lambda: client.list_regions(prefix + "/") == [], "the lease to remove the regions", 30, pause=0.2)
