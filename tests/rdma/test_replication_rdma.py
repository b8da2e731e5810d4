"""Replicated regions with rdma clients, on real verbs in the Soft-RoCE VM: reads over
rdma from the nearest copy, mutations through the primaries (which forward them to the
backups); the checks of tests/integration/replication/test_replication.py: concurrent
writers leave every copy identical (on the tier's two servers, each the primary of some
stripes and the backup of the others), and a primary killed mid-accumulate loses nothing
(on three servers of its own: exact sums at the promoted backup, then every copy
identical after the repair)."""
from __future__ import annotations

import pytest

from tests.integration.replication.test_replication import check_concurrent_writers, check_primary_killed
from tests.rdma.conftest import rdma_cluster

pytestmark = pytest.mark.rdma
MiB = 1 << 20


@pytest.fixture
def three():
    """Three rdma memory servers (clients use rdma for reads, not shm)."""
    with rdma_cluster(3, "128M", log_prefix="replicas-") as c:
        yield c


def test_primary_killed_mid_operation_applies_once_rdma(three):
    with three.client(transport="rdma") as c:
        r = c.create_region("job/probe", MiB, replicas=2)
        assert set(r.transports().values()) == {"rdma"}     # reads over rdma
        c.delete_region("job/probe")
        check_primary_killed(three, c, "job/fail", size=6 * MiB)


def test_concurrent_writers_leave_every_copy_identical_rdma(cluster, name):
    with cluster.client(transport="rdma") as c:
        check_concurrent_writers(c, name)
