"""Published weights read over rdma (tests/integration/weights/checks.py's round trip:
a server-side wait woken by a publish, every shard kind, a set of whole tensors and
bfloat16 on read, exact contents), the publisher on tcp."""
from __future__ import annotations

import pytest

from tests.integration.weights.checks import check_publish_subscribe

pytestmark = pytest.mark.rdma


def test_publish_and_subscribe_rdma(cluster, name):
    with cluster.client(transport="tcp") as trainer, cluster.client(transport="rdma") as reader:
        check_publish_subscribe(trainer, reader, name)
