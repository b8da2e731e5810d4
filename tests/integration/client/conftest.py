"""Fixtures of the data-plane tests (tests/rdma overrides ``tclient`` with an rdma client)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from smb_client import Client


@pytest.fixture(params=["tcp", "shm"])
def tclient(request, cluster) -> Iterator[Client]:
    """A client of the shared cluster on each host transport in turn."""
    with cluster.client(transport=request.param) as c:
        yield c
