"""Roles on the controller: a client token cannot act as a memory server or an admin, a
server credential speaks for its own id only, and the admin credential drains."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import smb_client
from smb_protocol import errors, rpc
from smb_protocol._proto.smb.v1 import controller_pb2 as pb
from smb_protocol._proto.smb.v1 import controller_pb2_grpc as pb_grpc
from smb_server.commands.local_cluster import LocalCluster
from smb_server.runtime.credentials import server_credential

MiB = 1 << 20


@pytest.fixture
def stub(fresh_cluster):
    channel = rpc.channel(fresh_cluster.address)
    yield pb_grpc.ControllerStub(channel)
    channel.close()


def _secret(cluster) -> bytes:
    return bytes.fromhex(cluster.secret_file.read_text().strip())


def _servers(cluster) -> dict:
    with cluster.client() as c:
        return {s.server_id: s for s in c.list_servers()}


def test_client_token_cannot_register_unregister_or_drain(fresh_cluster, stub):
    cluster = fresh_cluster
    victim = cluster.server_id(0)
    before = _servers(cluster)[victim]
    hijack = pb.RegisterServerRequest(server_id=victim, grpc_address="10.66.66.66:1",
                                      endpoints=["tcp://10.66.66.66:1"], capacity_bytes=MiB)
    with pytest.raises(errors.PermissionDenied, match="needs the server role"):
        rpc.call(stub.RegisterServer, hijack, cluster.token, 5)
    with pytest.raises(errors.PermissionDenied, match="needs the server role"):
        rpc.call(stub.Heartbeat, pb.HeartbeatRequest(server_id=victim), cluster.token, 5)
    with pytest.raises(errors.PermissionDenied, match="needs the server role"):
        rpc.call(stub.UnregisterServer, pb.UnregisterServerRequest(server_id=victim), cluster.token, 5)
    with pytest.raises(errors.PermissionDenied, match="needs the admin role"):
        cluster.client().drain_server(victim)
    after = _servers(cluster)[victim]
    assert (after.grpc_address, after.state) == (before.grpc_address, "up")
    assert "refused RegisterServer" in cluster.log_tail("controller", 200)


def test_server_credential_acts_for_its_own_id_only(fresh_cluster, stub):
    cluster = fresh_cluster
    a, b = cluster.server_id(0), cluster.server_id(1)
    cred_a = server_credential(_secret(cluster), a)
    hijack = pb.RegisterServerRequest(server_id=b, grpc_address="10.66.66.66:1", capacity_bytes=MiB)
    with pytest.raises(errors.PermissionDenied, match=f"may not act for server '{b}'"):
        rpc.call(stub.RegisterServer, hijack, cred_a, 5)
    with pytest.raises(errors.PermissionDenied):
        rpc.call(stub.UnregisterServer, pb.UnregisterServerRequest(server_id=b), cred_a, 5)
    with pytest.raises(errors.PermissionDenied, match="needs the admin role"):
        rpc.call(stub.DrainServer, pb.DrainServerRequest(server_id=b), cred_a, 5)
    with pytest.raises(errors.PermissionDenied, match="needs the client role"):
        rpc.call(stub.CreateRegion, pb.CreateRegionRequest(name="roles/x", size=MiB), cred_a, 5)
    forged = server_credential(b"not the secret", b)
    with pytest.raises(errors.AuthenticationError):
        rpc.call(stub.Heartbeat, pb.HeartbeatRequest(server_id=b), forged, 5)
    assert _servers(cluster)[b].grpc_address != "10.66.66.66:1"
    # its own id: a heartbeat is accepted
    rpc.call(stub.Heartbeat, pb.HeartbeatRequest(server_id=a), cred_a, 5)


def test_admin_drains_and_removes(fresh_cluster):
    cluster = fresh_cluster
    victim = cluster.server_id(0)
    with cluster.admin_client() as admin:
        assert admin.drain_server(victim).state == "draining"
        assert admin.drain_server(victim, undrain=True).state == "up"
        admin.create_region("roles/admin", MiB).close()            # admin may do what clients do
        admin.delete_region("roles/admin")
    channel = rpc.channel(cluster.address)
    try:                                                           # and remove a server
        removed = rpc.call(pb_grpc.ControllerStub(channel).UnregisterServer,
                           pb.UnregisterServerRequest(server_id=cluster.server_id(1), reason="test"),
                           cluster.admin_token, 5)
        assert removed.server.server_id == cluster.server_id(1)
    finally:
        channel.close()
    # the CLI takes the admin credential from the environment, never from argv
    env = dict(os.environ, SMB_ADMIN_TOKEN=cluster.admin_token, SMB_TOKEN=cluster.token)
    env.pop("SMB_SECRET", None)
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "server", "drain",
                          "--controller", cluster.address, "--server-id", victim],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert _servers(cluster)[victim].state == "draining"
    env.pop("SMB_ADMIN_TOKEN")
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "server", "undrain",
                          "--controller", cluster.address, "--server-id", victim],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "needs the admin role" in out.stderr


def test_separate_admin_token_from_a_file(tmp_path):
    token_file = tmp_path / "admin-token"
    token_file.write_text("ops-only-token\n")
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"), log_level="WARNING",
                      env={"SMB_ADMIN_TOKEN_FILE": str(token_file)}) as cluster:
        victim = cluster.server_id(0)
        with smb_client.connect(cluster.address, token="ops-only-token") as ops:
            assert ops.drain_server(victim).state == "draining"
        with smb_client.connect(cluster.address, token="ops-only-tokenX") as wrong:
            with pytest.raises(errors.AuthenticationError):
                wrong.drain_server(victim)
        with cluster.admin_client() as admin:                    # the derived one still works
            assert admin.drain_server(victim, undrain=True).state == "up"
