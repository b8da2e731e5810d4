"""The data-plane integration tests of tests/integration/client/test_dataplane.py, again over
rdma, against a real local cluster (controller + two memory servers with rdma)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from smb_protocol import errors
from tests.integration.client.test_dataplane import (  # noqa: F401  (collected here with transport=rdma)
    test_accumulate_bfloat16,
    test_accumulate_every_dtype,
    test_async_and_batched_forms,
    test_atomics,
    test_fetch_add_many,
    test_open_by_name_sees_same_memory,
    test_scale_and_axpy,
    test_transport_is_the_one_asked_for,
    test_write_read_roundtrip,
)

pytestmark = pytest.mark.rdma
MiB = 1 << 20


@pytest.fixture
def tclient(cluster):
    with cluster.client(transport="rdma") as c:
        yield c


def test_servers_advertise_rdma(cluster):
    with cluster.client() as c:
        for s in c.list_servers():
            assert any(e.startswith("rdma://") for e in s.endpoints), s.endpoints


def test_auto_picks_rdma_for_a_remote_server_with_a_device(cluster, name):
    with cluster.client() as c:
        r = c.create_region(name, 2 * MiB)
        assert set(r.transports().values()) == {"rdma"}
        c.delete_region(name)


def test_deleted_region_handle_fails(tclient, name):
    r = tclient.create_region(name, 4 * MiB, stripe_unit=MiB)
    r.write(0, np.ones(MiB, np.float32))
    tclient.delete_region(name)
    with pytest.raises(errors.NotFound):
        r.read(0, 4096)
    with pytest.raises(errors.NotFound):
        r.write(0, b"after delete")
    r.close()


def test_read_only_handle(cluster, tclient, name):
    r = tclient.create_region(name, MiB)
    r.write(0, b"shared weights")
    ro = tclient.open_region(name, "ro")
    assert bytes(ro.read(0, 14)) == b"shared weights"
    with pytest.raises(errors.ReadOnly):
        ro.write(0, b"x")
    ro.close()
    r.close()
    tclient.delete_region(name)


def test_a_region_deleted_under_every_pooled_queue_pair_leaves_the_next_one_usable(tclient, name):
    """The server closes every queue pair that carried a deleted region's ticket; the
    client learns it one QP at a time, and keeps connecting new ones until one works
    (it gave up after the second closed QP of a pool of two, before)."""
    a = tclient.create_region(f"{name}-a", 4 * MiB, stripe_unit=MiB)
    a.write(0, np.ones(MiB, np.float32))
    with ThreadPoolExecutor(4) as pool:   # every pooled QP of every server carries a's ticket
        for got in pool.map(lambda _: a.read(0, 4 * MiB), range(16)):
            assert len(got) == 4 * MiB
    tclient.delete_region(f"{name}-a")
    a.close()
    b = tclient.create_region(f"{name}-b", 4 * MiB, stripe_unit=MiB)
    b.write(0, np.full(MiB, 2, np.float32))
    np.testing.assert_array_equal(np.frombuffer(b.read(0, 4 * MiB), np.float32), np.full(MiB, 2))
    tclient.delete_region(f"{name}-b")
