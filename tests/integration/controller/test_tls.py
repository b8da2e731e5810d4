"""TLS on the control plane and the TCP data plane: a local cluster with a throw-away CA
(the daemons require client certificates) serves a client that has the cluster's CA and
certificate, and refuses, with AuthenticationError naming the setting to fix, a client
with another CA, one without a certificate and one with TLS off; a TCP data plane does
its TLS handshakes on the connection's thread under the HELLO deadline."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

from smb_client import Client, Region
from smb_client.transports.tcp import TcpSession
from smb_protocol import tickets
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import AuthenticationError, ServerBusy
from smb_protocol.tls import TLSConfig
from smb_server.commands.local_cluster import LocalCluster
from smb_server.memserver.arena import Arena
from smb_server.memserver.node import Node
from smb_server.memserver.tcp_plane import TcpPlane
from smb_server.runtime.certs import make_cluster_certs

MiB = 1 << 20
SECRET = b"t" * 32


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    with LocalCluster(servers=2, capacity="128M", transports="tcp,shm", log_level="WARNING",
                      workdir=str(tmp_path_factory.mktemp("tls") / "cluster"),
                      tls_client_auth=True) as c:
        yield c


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """Certificates from a CA the cluster does not know."""
    return make_cluster_certs(str(tmp_path_factory.mktemp("other-ca")))


def test_region_operations_over_tls(tls_cluster):
    with tls_cluster.client(transport="tcp") as c:
        assert all(e.startswith(("tcp+tls://", "shm://")) for s in c.list_servers() for e in s.endpoints)
        r = c.create_region("tls/ops", 32 * MiB, stripe_unit=MiB)   # both servers, scatter/gather
        a = np.arange(4 * MiB, dtype=np.float32)                 # 16 MiB: many TLS records
        r.write(0, a)
        r.accumulate(0, a)
        np.testing.assert_array_equal(r.read(0, a.nbytes, np.float32), 2 * a)
        small = np.arange(10, dtype=np.int64)                    # one record, header included
        r.write(16 * MiB, small)
        np.testing.assert_array_equal(r.read(16 * MiB, small.nbytes, np.int64), small)
        assert r.fetch_add(16 * MiB, 5) == 0
        assert r.compare_swap(16 * MiB, 5, 7) == 5
        waiter = c.dataplane.submit(r.wait, 16 * MiB, value=8, timeout=30)   # served while it waits
        time.sleep(0.2)
        assert r.fetch_add(16 * MiB, 1) == 7
        assert waiter.result(30) == 8
        assert r.transports() and set(r.transports().values()) == {"tcp+tls"}
        c.delete_region("tls/ops")


def test_shm_arithmetic_goes_over_the_tls_plane(tls_cluster):
    with tls_cluster.client() as c:                      # auto: shm on this host
        r = c.create_region("tls/shm", 2 * MiB)
        assert set(r.transports().values()) == {"shm"}
        a = np.arange(MiB // 4, dtype=np.float32)
        r.write(0, a)
        r.accumulate(0, a)                               # through the server, over tcp+tls
        np.testing.assert_array_equal(r.read(0, a.nbytes, np.float32), 2 * a)
        assert any(uri.startswith("tcp+tls://") for uri in c.dataplane.sessions())
        c.delete_region("tls/shm")


def test_all_reduce_over_tls(tls_cluster):
    """Two parties' pushes and pulls wait at the server on tcp+tls connections."""
    from smb_client.collective import Collective
    with tls_cluster.client() as c1, tls_cluster.client() as c2:
        first = Collective.create(c1, "tls/allreduce", 3 * MiB, parties=2, timeout=30)
        second = Collective.open(c2, "tls/allreduce", parties=2, timeout=30)
        a, b = np.full(MiB // 2, 1.5, np.float32), np.arange(MiB // 2, dtype=np.float32)
        expected = a + b
        other = c2.dataplane.submit(second.all_reduce, b)
        first.all_reduce(a)
        other.result(30)
        np.testing.assert_array_equal(a, expected)
        np.testing.assert_array_equal(b, expected)
        second.close()
        first.destroy()


def refused_by_the_controller(cluster, tls: TLSConfig, match: str) -> None:
    """A client with ``tls`` is refused by the controller: AuthenticationError matching ``match``."""
    with Client(cluster.address, cluster.token, tls=tls) as c:
        with pytest.raises(AuthenticationError, match=match):
            c.list_servers()


def refused_by_the_data_plane(cluster, tls: TLSConfig, match: str, region: str,
                              use: Callable[[Region], object]) -> None:
    """A client the controller trusts, whose tcp data plane has ``tls``, is refused by
    the memory server when it does ``use`` on ``region`` (created for it by a good
    client, deleted after): AuthenticationError matching ``match``."""
    with cluster.client() as good:
        good.create_region(region, MiB)
    with cluster.client(transport="tcp", transport_options={"tls": tls}) as c:
        r = c.open_region(region)
        with pytest.raises(AuthenticationError, match=match):
            use(r)
        c.delete_region(region)


def test_wrong_ca_is_refused_on_grpc_and_data_plane(tls_cluster, other_ca):
    start = time.monotonic()
    refused_by_the_controller(tls_cluster, other_ca.client(), "SMB_TLS_CA")
    assert time.monotonic() - start < 3, "refused at once, not after the reconnect patience"
    # the controller trusted, a memory server signed by another CA: the data plane refuses it
    refused_by_the_data_plane(tls_cluster, other_ca.client(), "SMB_TLS_CA", "tls/ca", lambda r: r.read(0, 64))


def test_client_without_certificate_is_refused(tls_cluster):
    no_cert = TLSConfig(ca=tls_cluster.certs.ca)
    refused_by_the_controller(tls_cluster, no_cert, "SMB_TLS_CERT")
    refused_by_the_data_plane(tls_cluster, no_cert, "SMB_TLS_CERT", "tls/nocert", lambda r: r.write(0, b"x" * 64))


def test_client_certificate_of_another_ca_is_refused(tls_cluster, other_ca):
    foreign = TLSConfig(tls_cluster.certs.ca, other_ca.client_cert, other_ca.client_key)
    refused = "does not accept this client's certificate"
    refused_by_the_controller(tls_cluster, foreign, refused)
    refused_by_the_data_plane(tls_cluster, foreign, refused, "tls/foreign", lambda r: r.read(0, 64))


def test_client_with_tls_off_is_told_the_controller_serves_tls(tls_cluster):
    refused_by_the_controller(tls_cluster, TLSConfig(), "serves TLS.*SMB_TLS_CA")


def test_smb_server_drain_uses_the_servers_tls_settings(tls_cluster):
    """An operator's `smb server drain` on a memory server host reaches a TLS controller
    with the server's own tls_* settings (its file, flags or variables)."""
    daemon = tls_cluster.certs.daemon()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    server_id = tls_cluster.server_id(0)
    for action in ("drain", "undrain"):
        out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "server", action,
                              "--server-id", server_id, "--controller", tls_cluster.address,
                              "--secret-file", str(tls_cluster.secret_file), "--tls-ca", daemon.ca,
                              "--tls-cert", daemon.cert, "--tls-key", daemon.key],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert server_id in out.stdout


def test_a_plain_local_cluster_ignores_the_shells_tls_variables(monkeypatch, other_ca):
    """A shell that kept a TLS cluster's client settings starts a plain cluster as plain."""
    client = other_ca.client()
    for key, value in (("SMB_TLS_CA", client.ca), ("SMB_TLS_CERT", client.cert), ("SMB_TLS_KEY", client.key)):
        monkeypatch.setenv(key, value)
    with LocalCluster(servers=1, capacity="64M", transports="tcp", log_level="WARNING") as plain:
        with plain.client() as c:
            assert [e[:6] for s in c.list_servers() for e in s.endpoints] == ["tcp://"]
        with Client(plain.address, plain.token, tls=client) as c:       # TLS to a plain controller
            with pytest.raises(AuthenticationError, match="does not speak TLS"):
                c.list_servers()


def test_tls_handshake_runs_on_the_connection_thread_under_the_hello_deadline(tmp_path):
    certs = make_cluster_certs(str(tmp_path / "ca"))
    arena = Arena(16 * MiB)
    arena.reserve(1, "tls-uid", MiB)
    ctx = certs.daemon().server_context()
    try:
        with TcpPlane(Node(arena, SECRET), hello_timeout=0.5, tls=ctx) as plane:
            silent = socket.create_connection(("127.0.0.1", plane.port))   # never says hello
            session = TcpSession(parse_endpoint(f"tcp+tls://127.0.0.1:{plane.port}"),
                                 {"tls": certs.client(), "io_timeout": 10})
            token = tickets.sign(SECRET, "tls-uid", [1], "rw", ttl=60.0)[0]
            session.write(token, 1, 0, [memoryview(b"abcd")])         # served meanwhile
            out = bytearray(4)
            session.read_into(token, 1, 0, [memoryview(out)])
            assert out == b"abcd"
            ready, _, _ = select.select([silent], [], [], 5)
            assert ready and silent.recv(1) == b"", "the silent connection was dropped"
            assert plane.stats.limits()["dropped"] >= 1
            silent.close()
            session.close()
    finally:
        arena.close()


def test_a_full_tls_plane_refuses_with_server_busy(tmp_path):
    certs = make_cluster_certs(str(tmp_path / "ca"))
    arena = Arena(16 * MiB)
    arena.reserve(1, "tls-uid", MiB)
    token = tickets.sign(SECRET, "tls-uid", [1], "rw", ttl=60.0)[0]
    try:
        with TcpPlane(Node(arena, SECRET), max_connections=1, tls=certs.daemon().server_context()) as plane:
            uri = parse_endpoint(f"tcp+tls://127.0.0.1:{plane.port}")
            first = TcpSession(uri, {"tls": certs.client(), "connections": 1})
            first.write(token, 1, 0, [memoryview(b"abcd")])           # holds the only slot
            second = TcpSession(uri, {"tls": certs.client()})
            with pytest.raises(ServerBusy, match="tcp_connections_max"):
                second.read_into(token, 1, 0, [memoryview(bytearray(4))])
            first.close()
            second.close()
    finally:
        arena.close()


def test_smb_up_tls_prints_what_clients_need(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "smb_server.commands.cli", "up", "--tls", "--port", "0",
                             "--memory-servers", "1", "--capacity", "64M",
                             "--workdir", str(tmp_path / "up")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env: dict[str, str] = {}
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while "SMB_TLS_KEY" not in env and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("export "):
                key, _, value = line[len("export "):].strip().partition("=")
                env[key] = value
        assert {"SMB_CONTROLLER", "SMB_TOKEN", "SMB_TLS_CA", "SMB_TLS_CERT", "SMB_TLS_KEY"} <= set(env)
        tls = TLSConfig.from_env(env)
        assert os.path.dirname(tls.ca) == str(tmp_path / "up" / "tls")
        with Client(env["SMB_CONTROLLER"], env["SMB_TOKEN"], tls=tls) as c:
            r = c.create_region("tls/up", MiB)
            r.write(0, b"hello")
            assert bytes(r.read(0, 5)) == b"hello"
    finally:
        proc.terminate()
        proc.wait(30)
