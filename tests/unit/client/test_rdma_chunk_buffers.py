"""The ring a collective's rdma stream allocates staging and bounce space from
(smb_client/transports/rdma/chunk_buffers.py), and the exchange's transport choice."""
from __future__ import annotations

import random

import pytest

from smb_client.exchange import ENV_TRANSPORT, exchange_transport
from smb_client.transports.rdma.chunk_buffers import Ring
from smb_protocol.errors import InvalidArgument


def test_ranges_never_overlap_whatever_order_they_are_freed_in():
    rng = random.Random(5)
    ring = Ring(1000)
    live: dict[int, tuple[int, int]] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.5 or len(live) > 6):
            token = rng.choice(list(live))
            ring.free(token)
            del live[token]
            continue
        n = rng.randint(1, 400)
        got = ring.take(n)
        if got is None:
            assert live, "an empty ring refused a range that fits"
            continue
        token, at = got
        assert 0 <= at and at + n <= 1000
        assert all(at + n <= s or e <= at for s, e in live.values()), (at, n, live)
        live[token] = (at, at + n)


def test_a_full_ring_refuses_until_a_range_is_freed_and_a_too_large_one_is_an_error():
    ring = Ring(100)
    first = ring.take(60)
    assert first is not None and first[1] == 0
    second = ring.take(40)
    assert second is not None and second[1] == 60
    assert ring.take(10) is None
    ring.free(first[0])
    third = ring.take(50)
    assert third is not None and third[1] == 0      # wrapped to the start
    with pytest.raises(InvalidArgument, match="do not fit"):
        ring.take(101)


def test_the_exchange_transport_is_auto_unless_told_tcp(monkeypatch):
    monkeypatch.delenv(ENV_TRANSPORT, raising=False)
    assert exchange_transport(None) == "auto"
    assert exchange_transport("tcp") == "tcp"
    monkeypatch.setenv(ENV_TRANSPORT, "tcp")
    assert exchange_transport(None) == "tcp"
    assert exchange_transport("auto") == "auto"
    monkeypatch.setenv(ENV_TRANSPORT, "udp")
    with pytest.raises(InvalidArgument, match="SMB_EXCHANGE_TRANSPORT"):
        exchange_transport(None)
    with pytest.raises(InvalidArgument, match="'auto' or 'tcp'"):
        exchange_transport("rdma")
