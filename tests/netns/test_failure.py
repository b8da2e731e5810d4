"""A memory server's link goes down mid-run: a typed error within the lease, the other
server keeps working, and the server rejoins when its link returns."""
from __future__ import annotations

import pytest

from bench.cluster import experiments, netns
from bench.cluster.testbed import Testbed

pytestmark = pytest.mark.netns

LEASE = 5.0          # seconds, the controller's lease (its default)
CAP_MBIT = 200.0


@pytest.mark.timeout(150)
def test_link_down_then_up():
    with Testbed(2, 1, cap_mbit=CAP_MBIT, lease_seconds=LEASE, log_level="INFO") as tb:
        # the client's default options: no io_timeout below the lease, the tcp transport's
        # dead-peer detection has to find the lost server by itself
        r = experiments.link_failure(tb, max_wait=20.0, rejoin_timeout=20.0)
        servers = {s["server_id"]: s["state"] for s in tb.list_servers()}
        tag = tb.tag
    err = r.get("error")
    assert err, f"no error while the link was down: {r}"
    # a clear, typed error naming the server, within the lease: never a hang
    assert err["type"] in ("Timeout", "ServerUnavailable") and err["unavailable_or_timeout"], err
    assert r["server_address"] in err["message"], err
    assert err["after_down_seconds"] <= LEASE, err
    assert r["reads_before"] > 0
    # so does the next operation, which has to open a new connection
    retry = r["retry_error"]
    assert retry and retry["type"] in ("Timeout", "ServerUnavailable") and retry["op_seconds"] <= LEASE, retry
    # the region on the other server kept working meanwhile
    assert r["other_region"]["ok"], r["other_region"]
    # the controller noticed, and took the server back when the link returned
    assert r["marked_down_after_seconds"] is not None, r
    assert r["rejoined_after_seconds"] is not None, r
    assert r["recovered_after_seconds"] is not None and r["data_intact"], r
    assert set(servers.values()) == {"up"}, servers
    assert "tbf" in r["qdisc_after"]["host"] and f"rate {CAP_MBIT:g}Mbit" in r["qdisc_after"]["host"]
    assert [n for n in netns.list_namespaces() if n.startswith(tag + "-")] == []
