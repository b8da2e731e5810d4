"""Replicated regions with rdma clients, on real verbs in the Soft-RoCE VM: reads over
rdma from the nearest copy, mutations through the primaries (which forward them to the
backups); the copy-invariant and exactly-once-across-failover checks of
tests/integration/test_replication.py, on a cluster of three rdma memory servers."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

import pytest

from smb_server.local_cluster import LocalCluster
from tests.integration.test_replication import check_concurrent_writers, check_primary_killed

pytestmark = pytest.mark.rdma
MiB = 1 << 20


@pytest.fixture
def three():
    """Three rdma memory servers reporting another host id (so clients use rdma, not shm)."""
    work = tempfile.mkdtemp(prefix="smb-rdma-replicas-")  # local disk: SQLite WAL needs mmap
    try:
        with LocalCluster(servers=3, capacity="128M", transports="tcp,shm,rdma", log_level="INFO",
                          env={"SMB_HOST_ID": "memory-box-host"}, workdir=work) as c:
            yield c
    finally:
        logs = os.environ.get("SMB_TEST_LOGDIR")      # the VM runner keeps the daemon logs
        if logs:
            for log in glob.glob(os.path.join(work, "**", "*.log"), recursive=True):
                shutil.copy(log, os.path.join(logs, "replicas-" + os.path.basename(log)))
        shutil.rmtree(work, ignore_errors=True)


def test_concurrent_writers_leave_every_copy_identical_rdma(three):
    with three.client(transport="rdma") as c:
        r = c.create_region("job/probe", MiB, replicas=2)
        assert set(r.transports().values()) == {"rdma"}
        c.delete_region("job/probe")
        check_concurrent_writers(c, "job/conc", size=4 * MiB, chunk=100_000)


def test_primary_killed_mid_operation_applies_once_rdma(three):
    with three.client(transport="rdma") as c:
        check_primary_killed(three, c, "job/fail", size=6 * MiB)
