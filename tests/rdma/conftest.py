"""The rdma tier: real verbs on a Soft-RoCE device (run by ``tests/rdma/run_vm.sh``).

On a host without an RDMA device every test here is skipped with the reason; inside
the VM (``SMB_RDMA_VM=1``) a missing device is an error instead, never a silent pass.
"""
from __future__ import annotations

import os

import pytest

from smb_client import verbs

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
