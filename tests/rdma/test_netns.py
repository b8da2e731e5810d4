"""A striped region over two memory servers in two network namespaces, each with its
own rxe device (set up by tests/rdma/netns_setup.sh inside the VM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from smb_client import Client
from smb_protocol.rdma import verbs
from smb_server.runtime.config import new_secret, new_token

pytestmark = [pytest.mark.rdma, pytest.mark.netns]
MiB = 1 << 20
SERVERS = {"smb-a": ("rxea", "198.19.1.1", "198.19.1.2"), "smb-b": ("rxeb", "198.19.2.1", "198.19.2.2")}


def _ready(path, proc, what, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            try:
                return json.loads(open(path).read())
            except ValueError:
                pass
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{what} not ready in {timeout} s")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    if not {"rxea", "rxeb", "rxec"} <= set(verbs.device_names()):
        pytest.fail("rxea/rxeb/rxec missing: tests/rdma/netns_setup.sh did not run (VM only)")
    work = tmp_path_factory.mktemp("netns")
    secret = work / "secret"
    secret.write_text(new_secret().hex())
    token = new_token()
    env = dict(os.environ, SMB_TOKEN=token)
    procs = []
    logs = []

    def spawn(name, cmd, extra=None):
        log = open(work / f"{name}.log", "wb")
        logs.append(log)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env, **(extra or {})))
        procs.append(p)
        return p

    py = [sys.executable, "-m", "smb_server.commands.cli", "--log-level", "INFO"]
    ctl = spawn("controller", py + ["controller", "--listen", "0.0.0.0:0", "--db", str(work / "db"),
                                    "--secret-file", str(secret), "--ready-file", str(work / "ctl.ready"),
                                    "--lease", "5"])
    try:
        port = int(_ready(work / "ctl.ready", ctl, "controller")["address"].rpartition(":")[2])
        for ns, (dev, gw, ip) in SERVERS.items():
            spawn(ns, ["ip", "netns", "exec", ns] + py + [
                "server", "--controller", f"{gw}:{port}", "--listen-host", ip, "--capacity", "64M",
                "--secret-file", str(secret), "--ready-file", str(work / f"{ns}.ready"),
                "--state-dir", str(work / ns), "--transports", "tcp,rdma", "--heartbeat", "0.5"],
                {"SMB_RDMA_DEVICE": dev})
        for i, ns in enumerate(SERVERS):
            ready = _ready(work / f"{ns}.ready", procs[i + 1], ns)
            assert any(e.startswith("rdma://") for e in ready["endpoints"]), ready
        yield f"127.0.0.1:{port}", token, work
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()


def test_striped_region_over_two_namespaces(two_hosts, monkeypatch):
    address, token, work = two_hosts
    monkeypatch.setenv("SMB_RDMA_DEVICE", "rxec")          # the client's own rxe device
    with Client(address, token, transport="rdma") as c:
        servers = c.list_servers()
        assert len(servers) == 2 and {s.grpc_address.rpartition(":")[0] for s in servers} == \
            {"198.19.1.2", "198.19.2.2"}
        r = c.create_region("netns/striped", 6 * MiB + 100, stripe_unit=256 << 10)
        assert len({e.server_id for e in r.extents}) == 2
        assert set(r.transports().values()) == {"rdma"}
        data = np.random.default_rng(7).integers(0, 256, r.size, dtype=np.uint8)
        r.write(0, data)
        assert np.array_equal(np.frombuffer(r.read(), np.uint8), data)
        x = np.arange(MiB // 4, dtype=np.float32)
        r.write(0, np.zeros(MiB // 4, np.float32))
        r.accumulate(0, x)
        r.accumulate(0, x)
        np.testing.assert_array_equal(r.read(0, MiB, dtype="float32"), 2 * x)
        word = 2 * MiB + (256 << 10)                     # on the second server, untouched since
        assert r.fetch_add(word, 3) == int(data[word:word + 8].view("<i8")[0])
        r.close()
        c.delete_region("netns/striped")
