"""Replicated regions with rdma clients, on real verbs in the Soft-RoCE VM: reads over
rdma from the nearest copy, mutations through the primaries (which forward them to the
backups); the exactly-once-across-failover check of tests/integration/test_replication.py
(a primary killed mid-accumulate: exact sums at the promoted backup, then every copy
identical after the repair), on a cluster of three rdma memory servers.

The concurrent-writers check runs on the host tier only: in the emulated VM its load
starves the servers past the forwarding dead-peer time, backups are dropped as
unreachable, and in two of three runs a region did not get back to ``ready`` within
120 s (an open problem of the repair under repeated false failures)."""
from __future__ import annotations

import pytest

from tests.integration.test_replication import check_primary_killed
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
