"""TLS settings, endpoint choice and the framing loops over real TLS sockets."""
from __future__ import annotations

import socket
import threading

import pytest

from smb_client.dataplane import choose_endpoint
from smb_protocol import wire
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import InvalidArgument, ServerUnavailable
from smb_protocol.placement import ExtentPlace
from smb_protocol.tls import TLSConfig, untrusted
from smb_server.runtime.certs import make_cluster_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_cluster_certs(str(tmp_path_factory.mktemp("ca")))


def test_settings_come_from_the_environment_and_are_checked(tmp_path):
    tls = TLSConfig.from_env({"SMB_TLS_CA": "/a", "SMB_TLS_CERT": "/b", "SMB_TLS_KEY": "/c"})
    assert (tls.ca, tls.cert, tls.key, tls.enabled) == ("/a", "/b", "/c", True)
    assert not TLSConfig.from_env({}).enabled
    with pytest.raises(InvalidArgument, match="both a certificate and its key"):
        TLSConfig(ca="/a", cert="/b").check()
    with pytest.raises(InvalidArgument, match="tls_cert and tls_key"):
        TLSConfig(ca="/a").check(server=True)
    with pytest.raises(InvalidArgument, match="cannot read"):
        TLSConfig(ca=str(tmp_path / "missing.pem")).check()


def test_a_client_with_files_that_are_not_its_certificate_and_key_is_refused_at_once(certs):
    from smb_client import Client
    with pytest.raises(InvalidArgument, match="PEM CA, certificate and its private key expected"):
        Client("127.0.0.1:1", "t", tls=TLSConfig(certs.ca, certs.client_cert, certs.server_key))


def test_refusals_name_the_setting_to_fix():
    assert "SMB_TLS_CA" in str(untrusted("tcp+tls://h:1", "certificate verify failed"))
    assert "SMB_TLS_CERT" in str(untrusted("tcp+tls://h:1", "tlsv13 alert certificate required"))


def test_tls_endpoints_are_parsed_and_chosen_for_tcp():
    ep = parse_endpoint("tcp+tls://10.0.0.1:7701")
    assert (ep.scheme, ep.host, ep.port, str(ep)) == ("tcp+tls", "10.0.0.1", 7701, "tcp+tls://10.0.0.1:7701")
    place = ExtentPlace(1, "s1", 4096, "h:1", "other-host", ("tcp+tls://h:2", "shm:///x.sock"), "up")
    assert choose_endpoint(place, "auto", "this-host") == "tcp+tls://h:2"
    assert choose_endpoint(place, "tcp", "this-host") == "tcp+tls://h:2"


def test_framing_over_tls_moves_scattered_buffers_in_order(certs):
    """wire.sendmsg_all / recv_into_all take TLS sockets (which have no sendmsg and no
    recvmsg_into): small frames and large payloads, several buffers each way."""
    raw_server, raw_client = socket.socketpair()
    server_ctx = certs.daemon().server_context(require_client_cert=True)
    client_ctx = certs.client().client_context()
    result: dict[str, object] = {}

    def serve() -> None:
        with server_ctx.wrap_socket(raw_server, server_side=True) as s:
            small = bytearray(20)
            big = [memoryview(bytearray(3 << 20)), memoryview(bytearray(5))]
            wire.recv_into_all(s, [memoryview(small)])
            wire.recv_into_all(s, big)
            result["small"], result["big"] = bytes(small), b"".join(bytes(b) for b in big)
            wire.sendmsg_all(s, [b"ok", memoryview(b"!")])

    thread = threading.Thread(target=serve)
    thread.start()
    payload = bytes(range(256)) * (3 << 12)      # 3 MiB
    with client_ctx.wrap_socket(raw_client, server_hostname="localhost") as c:
        wire.sendmsg_all(c, [b"0123456789", memoryview(b"abcdefghij")])
        wire.sendmsg_all(c, [memoryview(payload)[:1 << 20], memoryview(payload)[1 << 20:], b"tail!"])
        answer = bytearray(3)
        wire.recv_into_all(c, [memoryview(answer)], deadline=None)
        thread.join(10)
        assert answer == b"ok!"
        with pytest.raises(ServerUnavailable):        # the server closed its side
            wire.recv_into_all(c, [memoryview(bytearray(1))])
    assert result["small"] == b"0123456789abcdefghij"
    assert result["big"] == payload + b"tail!"


def test_daemon_settings_refuse_tls_files_that_do_not_fit(certs, tmp_path):
    from smb_server.runtime.config import ConfigError, ServerConfig, load
    ok = load(ServerConfig, env={"SMB_TLS_CA": certs.ca, "SMB_TLS_CERT": certs.server_cert,
                                 "SMB_TLS_KEY": certs.server_key, "SMB_TLS_CLIENT_AUTH": "1"},
              with_secret=False)
    assert (ok.tls_ca, ok.tls_client_auth) == (certs.ca, True)
    with pytest.raises(ConfigError, match="tls_ca: cannot read"):
        load(ServerConfig, env={"SMB_TLS_CA": str(tmp_path / "missing.pem"), "SMB_TLS_CERT": certs.server_cert,
                                "SMB_TLS_KEY": certs.server_key}, with_secret=False)
    with pytest.raises(ConfigError, match="needs its certificate and key"):
        load(ServerConfig, env={"SMB_TLS_CA": certs.ca}, with_secret=False)
    with pytest.raises(ConfigError, match="PEM CA, certificate and its private key expected"):
        load(ServerConfig, env={"SMB_TLS_CA": certs.ca, "SMB_TLS_CERT": certs.server_cert,
                                "SMB_TLS_KEY": certs.client_key}, with_secret=False)   # not its key
    with pytest.raises(ConfigError, match="tls_client_auth needs TLS"):
        load(ServerConfig, env={}, flags={"tls_client_auth": True}, with_secret=False)
