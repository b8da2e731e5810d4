"""The etcd client layer: store URLs, several endpoints, and etcd's refusals as typed
errors, against a real etcd server."""
from __future__ import annotations

import socket

import pytest

from smb_protocol import errors
from smb_server.controller import etcd_kv as kv
from smb_server.controller.etcd_state import MAX_TXN_OPS
from tests.etcd_server import EtcdServer


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("url, endpoints, prefix", [
    ("etcd://h1:2379,h2:2380", [("h1", 2379), ("h2", 2380)], "/smb"),
    ("etcd://h1/team-a/", [("h1", 2379)], "/team-a"),
    ("etcd://[::1]:2379/x/y", [("::1", 2379)], "/x/y"),
])
def test_store_urls(url: str, endpoints: list[tuple[str, int]], prefix: str) -> None:
    assert kv.parse_url(url) == (endpoints, prefix)


@pytest.mark.parametrize("url", ["etcd://", "etcd://,", "etcd://h1:port", "http://h1:2379", "etcd://:2379"])
def test_bad_store_urls(url: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        kv.parse_url(url)


def test_a_dead_endpoint_is_skipped(etcd_server: EtcdServer) -> None:
    client = kv.EtcdKV([("127.0.0.1", _closed_port()), ("127.0.0.1", etcd_server.port)], timeout=2)
    assert client.txn([kv.absent("/kvtest/a")], [kv.put("/kvtest/a", "1")]).succeeded
    got = client.get("/kvtest/a")
    assert got is not None and got.value == b"1"
    client.close()


def test_no_endpoint_answers(etcd_server: EtcdServer) -> None:
    client = kv.EtcdKV([("127.0.0.1", _closed_port())], timeout=2)
    with pytest.raises(errors.ControllerUnavailable, match="etcd does not answer"):
        client.get("/kvtest/b")


def test_a_request_etcd_refuses_is_a_server_error(etcd_server: EtcdServer) -> None:
    client = kv.EtcdKV([("127.0.0.1", etcd_server.port)])
    too_many = [kv.put(f"/kvtest/many/{k}", "x") for k in range(MAX_TXN_OPS + 1)]
    with pytest.raises(errors.ServerError, match="too many operations"):
        client.txn([], too_many)
    assert client.read(kv.get_prefix("/kvtest/many/")) == [[]]
