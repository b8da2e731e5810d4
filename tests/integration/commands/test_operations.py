"""Operating real daemons: readiness and clean shutdown on SIGTERM, the gRPC health
service, Prometheus metrics and `smb status`, drain, and a rolling restart that keeps
file-backed data."""
from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request

import numpy as np
import pytest

from smb_protocol import errors
from smb_server.commands.local_cluster import LocalCluster
from smb_server.runtime import health
from smb_server.testing import WAIT, wait_until
from tests.integration.daemons import free_port, scrape, smb, start_server

MiB = 1 << 20


def test_readiness_and_sigterm_release_extents_and_tell_the_controller(tmp_path, cluster_env):
    env, daemons, _ = cluster_env
    notify = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(WAIT)
    try:
        server = start_server(tmp_path, env, daemons, "s0", "--capacity", "64M",
                              extra_env={"NOTIFY_SOCKET": str(notify)})
        assert listener.recv(4096).startswith(b"READY=1\n")       # Type=notify readiness
        server_id = server.wait_ready()["server_id"]
        import smb_client
        with smb_client.connect(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport="shm") as c:
            r = c.create_region("ops/sigterm", 4 * MiB)
            assert {e.server_id for e in r.extents} == {server_id}
            r.write(0, np.full(MiB, 7, np.int32))
            assert r.read(0, 16, dtype="int32").tolist() == [7] * 4      # the extent is mapped here

            assert server.stop(signal.SIGTERM) == 0
            messages = []
            while not any(m.startswith(b"STOPPING=1") for m in messages):
                messages.append(listener.recv(4096))
            # told the controller: down at once, long before its 60 s lease ran out
            states = {s.server_id: s.state for s in c.list_servers()}
            assert states[server_id] == "down"
            assert [x.state for x in c.list_regions()] == ["degraded"]
            # released: the live word this process still maps is 0 and the data is gone
            with pytest.raises(errors.ExtentNotFound):
                r.read(0, 16)
            r.close()
        log = server.log.read_text()
        assert "received SIGTERM" in log and "released 1 extent(s)" in log
        assert "told the controller" in log
        assert f"server {server_id} stopped (SIGTERM): marked down" in daemons[0].log.read_text()
    finally:
        listener.close()


def test_health_metrics_and_status(tmp_path, cluster_env):
    env, daemons, ctl_metrics = cluster_env
    server_metrics = free_port()
    server = start_server(tmp_path, env, daemons, "s0", "--capacity", "64M", "--transports", "tcp",
                          "--metrics-port", str(server_metrics))
    ready = server.wait_ready()
    assert ready["metrics_port"] == server_metrics

    # gRPC health: no token needed; the daemon and its service by name
    for address, service in ((env["SMB_CONTROLLER"], "smb.v1.Controller"),
                             (ready["grpc_address"], "smb.v1.MemoryServer")):
        assert health.check(address) == "SERVING"
        assert health.check(address, service) == "SERVING"
        assert health.check(address, "no.such.Service") == "SERVICE_UNKNOWN"

    import smb_client
    with smb_client.connect(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport="tcp") as c:
        r = c.create_region("ops/metrics", 2 * MiB)
        r.write(0, np.ones(MiB // 4, np.float32))
        r.accumulate(0, np.ones(MiB // 4, np.float32))
        assert r.read(0, 8, dtype="float32").tolist() == [2.0, 2.0]
        with pytest.raises(errors.RegionNotFound):
            c.open_region("ops/missing")
        r.close()

    srv = scrape(server_metrics)
    assert srv[("smb_server_capacity_bytes", ())] == 64 * MiB
    assert srv[("smb_server_used_bytes", ())] == 2 * MiB
    assert srv[("smb_server_extents", ())] == 1 and srv[("smb_server_regions", ())] == 1
    assert srv[("smb_server_bytes_written_total", (("transport", "tcp"),))] == MiB
    assert srv[("smb_server_bytes_accumulated_total", (("transport", "tcp"),))] == MiB
    assert srv[("smb_server_bytes_read_total", (("transport", "tcp"),))] == 8
    for op in ("write", "accumulate", "read"):
        assert srv[("smb_server_operation_seconds_count", (("op", op), ("transport", "tcp")))] >= 1
    assert srv[("smb_server_rpc_seconds_count", (("method", "ReserveExtent"),))] == 1
    assert srv[("smb_server_registered", ())] == 1
    assert srv[("smb_server_chunk_pushes_total", (("lock", "free"),))] == 0

    ctl = scrape(ctl_metrics)
    assert ctl[("smb_controller_servers", (("state", "up"),))] == 1
    assert ctl[("smb_controller_regions", (("state", "ready"),))] == 1
    assert ctl[("smb_controller_used_bytes", (("server_id", ready["server_id"]),))] == 2 * MiB
    assert ctl[("smb_controller_rpc_seconds_count", (("method", "CreateRegion"),))] == 1
    assert ctl[("smb_controller_rpc_errors_total", (("code", "NOT_FOUND"), ("method", "OpenRegion")))] == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{ctl_metrics}/healthz", timeout=10) as reply:
        assert reply.status == 200

    out = smb("status", "--json", "--metrics", env=env)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["controller"]["health"] == "SERVING"
    (row,) = status["servers"]
    assert (row["server_id"], row["state"], row["health"]) == (ready["server_id"], "up", "SERVING")
    assert row["bytes_written"] == MiB and row["bytes_accumulated"] == MiB and row["errors"] == 0
    ops = {(e["op"], e["transport"]): e for e in row["latency_seconds"]}
    assert ops[("write", "tcp")]["count"] >= 1 and ops[("write", "tcp")]["p99"] > 0
    text = smb("status", "--metrics", env=env).stdout
    assert "SERVING" in text and "operation latency" in text and "ops/metrics" in text

    with smb_client.connect(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport="tcp") as c:
        coll = smb_client.Collective.create(c, "ops/coll", 3 * 4096, 1, chunk_bytes=4096)
        assert coll.all_reduce(np.ones(3 * 1024, np.float32)).tolist() == [1.0] * 3 * 1024
        coll.destroy()
    srv = scrape(server_metrics)    # its three chunk pushes, each alone on its chunk's lock
    assert srv[("smb_server_chunk_pushes_total", (("lock", "free"),))] == 3
    assert srv[("smb_server_chunk_pushes_total", (("lock", "waited"),))] == 0

    assert server.stop() == 0
    assert health.check(ready["grpc_address"], timeout=1) == "UNREACHABLE"
    row = json.loads(smb("status", "--json", env=env).stdout)["servers"][0]
    assert (row["state"], row["health"]) == ("down", "-")


def _server_args(cluster: LocalCluster, i: int) -> list[str]:
    # the server's own configuration: its secret file gives the admin credential
    return ["--state-dir", str(cluster.workdir / f"server-{i}"), "--controller", cluster.address,
            "--secret-file", str(cluster.secret_file)]


def test_drain_then_rolling_restart_keeps_file_backed_data(tmp_path):
    with LocalCluster(servers=2, capacity="128M", workdir=str(tmp_path / "cluster"), persistent=True,
                      lease_seconds=30, log_level="INFO") as cluster:
        c = cluster.client(transport="tcp")
        data = np.arange(2 * MiB, dtype=np.float32)            # 8 MiB striped over both servers
        r = c.create_region("ops/weights", data.nbytes, stripe_unit=MiB, persistent=True)
        assert len({e.server_id for e in r.extents}) == 2
        r.write(0, data)

        # drain server 0 through its own configuration (the id kept in its state dir)
        out = smb("server", "drain", *_server_args(cluster, 0))
        assert out.returncode == 0, out.stdout + out.stderr
        drained = cluster.server_id(0)
        assert f"server {drained}" in out.stdout and "draining" in out.stdout
        assert {s.server_id: s.state for s in c.list_servers()}[drained] == "draining"
        status = smb("status", env=dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token))
        assert f"draining (no new extents): {drained}" in status.stdout
        new = c.create_region("ops/new", 4 * MiB)
        assert {e.server_id for e in new.extents} == {cluster.server_id(1)}   # no new extents on 0
        r.accumulate(0, data)                                    # existing regions keep working
        np.testing.assert_array_equal(r.read(dtype="float32"), 2 * data)
        new.close()
        c.delete_region("ops/new")

        # rolling restart: one server at a time, each back before the next one stops
        for i in range(2):
            cluster.kill_server(i, signal.SIGTERM)
            assert cluster.servers[i].returncode == 0
            assert {s.server_id: s.state for s in c.list_servers()}[cluster.server_id(i)] == "down"
            cluster.start_server(i)
            wait_until(lambda i=i: {s.server_id: s.state for s in c.list_servers()}[cluster.server_id(i)]
                       in ("up", "draining"), f"server {i} back")
            back = c.open_region("ops/weights")                 # new ports: open again
            np.testing.assert_array_equal(back.read(dtype="float32"), 2 * data)
            back.close()
        assert [x.state for x in c.list_regions()] == ["ready"]
        # the drain survives the restart, until undrained
        assert {s.server_id: s.state for s in c.list_servers()}[drained] == "draining"
        out = smb("server", "undrain", *_server_args(cluster, 0))
        assert out.returncode == 0 and "up" in out.stdout, out.stdout + out.stderr
        again = c.create_region("ops/again", 4 * MiB)
        assert {e.server_id for e in again.extents} == {cluster.server_id(0), cluster.server_id(1)}
        again.close()
        r.close()
        c.close()


def test_drain_without_a_server_id_is_a_clear_error(tmp_path):
    out = smb("server", "drain", "--state-dir", str(tmp_path / "never-ran"), "--controller", "127.0.0.1:1",
              env={k: v for k, v in os.environ.items() if not k.startswith("SMB_")})
    assert out.returncode == 1
    assert "InvalidArgument" in out.stderr and "server_id" in out.stderr and "--server-id" in out.stderr
