"""The etcd client layer: store URLs, several endpoints, and etcd's refusals as typed
errors, against a real etcd server."""
from __future__ import annotations

import socket
import threading

import pytest

from smb_protocol import errors
from smb_server.controller.stores.etcd import kv
from smb_server.controller.stores.etcd.txn import MAX_TXN_OPS
from smb_server.testing import EtcdServer


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


def test_a_watch_sees_every_change_in_order(etcd_server: EtcdServer) -> None:
    client = kv.EtcdKV([("127.0.0.1", etcd_server.port)])
    start = client.txn([], [kv.put("/kvtest/w/a", "0")]).revision
    seen: list[kv.WatchEvent] = []
    three = threading.Event()

    def on_events(events: list[kv.WatchEvent]) -> None:
        seen.extend(events)
        if len(seen) >= 3:
            three.set()

    watch = client.watch("/kvtest/w/", start + 1, on_events, prefix=True)
    client.txn([], [kv.put("/kvtest/w/a", "1")])
    client.txn([], [kv.put("/kvtest/w/b", "2")])
    client.txn([], [kv.delete("/kvtest/w/a")])
    client.txn([], [kv.put("/kvtest/other", "x")])     # not under the prefix
    assert three.wait(10)
    watch.cancel()
    assert [(e.deleted, e.kv.key, e.kv.value) for e in seen] == [
        (False, "/kvtest/w/a", b"1"), (False, "/kvtest/w/b", b"2"), (True, "/kvtest/w/a", b"")]
    client.close()


def test_one_channel_balances_over_the_endpoints() -> None:
    assert kv.channel_target([("127.0.0.1", 1), ("127.0.0.1", 2)]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert kv.channel_target([("::1", 1), ("::1", 2)]) == "ipv6:[::1]:1,[::1]:2"
    assert kv.channel_target([("etcd.example", 2379)]) == "etcd.example:2379"
