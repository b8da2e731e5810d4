"""The rdma tier: real verbs on a Soft-RoCE device (run by ``tests/rdma/run_vm.sh``).

On a host without an RDMA device every test here is skipped with the reason; inside
the VM (``SMB_RDMA_VM=1``) a missing device is an error instead, never a silent pass.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from smb_protocol.rdma import verbs
from smb_server.commands.local_cluster import LocalCluster

VM_DEAD_PEER_SECONDS = 20.0
NO_DEVICE = ("no RDMA device on this host: the rdma tier runs inside a Soft-RoCE VM "
             "(tests/rdma/run_vm.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if verbs.has_device():
        return
    if os.environ.get("SMB_RDMA_VM") == "1":
        raise pytest.UsageError(f"inside the VM but {NO_DEVICE.split(':')[0]}: rdma_rxe setup failed")
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=NO_DEVICE)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@contextlib.contextmanager
def rdma_cluster(servers: int, capacity: str, log_prefix: str = "", metrics: bool = False) -> Iterator[LocalCluster]:
    """A local cluster of rdma memory servers that report another host id (so ``auto``
    must not pick shm), in a work folder on local disk (SQLite's WAL needs mmap); the
    daemon logs are kept in ``$SMB_TEST_LOGDIR`` (the VM runner's) as ``log_prefix`` + name;
    ``metrics``: every daemon serves Prometheus metrics.

    The memory servers give a silent backup ``VM_DEAD_PEER_SECONDS`` (not 3 s): the
    emulated VM's kernel can leave a busy server's TCP unacknowledged for seconds, and a
    primary would drop its backups as unreachable for that alone."""
    work = tempfile.mkdtemp(prefix="smb-rdma-cluster-")
    try:
        with LocalCluster(servers=servers, capacity=capacity, transports="tcp,shm,rdma", log_level="INFO",
                          env={"SMB_HOST_ID": "memory-box-host",
                               "SMB_REPLICA_DEAD_PEER_SECONDS": str(VM_DEAD_PEER_SECONDS)},
                          workdir=work, metrics=metrics) as c:
            yield c
    finally:
        logs = os.environ.get("SMB_TEST_LOGDIR")
        if logs:
            for log in glob.glob(os.path.join(work, "**", "*.log"), recursive=True):
                shutil.copy(log, os.path.join(logs, log_prefix + os.path.basename(log)))
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """Two rdma servers (in place of the shared loopback cluster) that report another
    host id, so ``auto`` must not pick shm; one for the whole tier, as the loopback one
    is for the host suite: starting a cluster takes about a minute under the VM's
    emulated CPUs. Tests that kill or drain servers start clusters of their own."""
    with rdma_cluster(2, "256M") as c:
        yield c
