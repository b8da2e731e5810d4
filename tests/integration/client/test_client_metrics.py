"""A client process's own latency histograms (smb_client.metrics): off by default, served
on a port the user names, under the memory servers' operation names."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smb_client import metrics
from smb_protocol import errors
from smb_protocol.latency import CLIENT_HISTOGRAM
from smb_protocol.wire import Op

MiB = 1 << 20


def counts(port: int) -> dict[str, float]:
    """Operations counted, by op, as a scrape of the client's /metrics shows them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == CLIENT_HISTOGRAM]
    return {s.labels["op"]: s.value for s in family.samples if s.name == f"{CLIENT_HISTOGRAM}_count"}


@pytest.fixture
def served():
    port = metrics.serve(0)
    try:
        yield port
    finally:
        metrics.disable()


def test_region_operations_are_counted_under_the_servers_names(client, name, served):
    region = client.create_region(name, MiB)
    region.write(0, bytes(4096))
    region.read(0, 4096)                                  # read() goes through read_into once
    region.accumulate(0, np.ones(1024, np.float32))
    region.fetch_add(8192, 1)
    region.write_many([(0, b"x"), (64, b"y")])
    client.open_region(name)
    with pytest.raises(errors.InvalidArgument):
        region.wait(8192, value=2, equals=3)              # refused before any request
    got = counts(served)
    assert got["write"] == 2 and got["read"] == 1 and got["accumulate"] == 1 and got["fetch_add"] == 1
    assert got["open"] == 1 and got["wait"] == 1          # a failed call is counted too
    region_ops = set(got) - {"open", "barrier", "broadcast"}
    assert region_ops <= {op.name.lower() for op in Op}, region_ops   # the servers' op label values
    client.delete_region(name)


def test_off_by_default_and_on_by_the_environment(cluster, name):
    """A process that sets nothing counts nothing; one with SMB_CLIENT_METRICS_PORT
    serves its histograms there from its first Client on."""
    script = textwrap.dedent(f"""
        import os, urllib.request
        from smb_client import Client, metrics
        with Client() as c:
            if "SMB_CLIENT_METRICS_PORT" not in os.environ:
                assert metrics._histogram is None
                print("off")
            else:
                c.create_region({name!r}, 4096).write(0, b"hello")
                port = int(os.environ["SMB_CLIENT_METRICS_PORT"])
                text = urllib.request.urlopen(f"http://127.0.0.1:{{port}}/metrics").read().decode()
                assert 'smb_client_operation_seconds_count{{op="write"}} 1.0' in text, text
                c.delete_region({name!r})
                print("on")
    """)
    env = {**os.environ, "SMB_CONTROLLER": cluster.address, "SMB_TOKEN": cluster.token}
    env.pop("SMB_CLIENT_METRICS_PORT", None)
    off = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and off.stdout.strip() == "off", off.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    on = subprocess.run([sys.executable, "-c", script], env={**env, "SMB_CLIENT_METRICS_PORT": str(port)},
                        capture_output=True, text=True, timeout=60)
    assert on.returncode == 0 and on.stdout.strip() == "on", on.stderr
