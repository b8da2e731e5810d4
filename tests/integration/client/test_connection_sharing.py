"""Connections belong to the client, per memory-server endpoint, not per region: a
parameter store of many regions on a few servers holds ``connections`` sockets to each
server (counted by the servers), and regions sharing a connection keep their own rights."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from smb_protocol import errors, rpc, tickets
from smb_protocol._proto.smb.v1 import memory_server_pb2, memory_server_pb2_grpc
from smb_server.commands.local_cluster import LocalCluster
from smb_server.testing import wait_until

MiB = 1 << 20
SERVERS = 4
REGIONS = 5
CONNECTIONS = 2


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A private cluster of four memory servers, tcp only: no other client counts."""
    with LocalCluster(servers=SERVERS, capacity="128M", transports="tcp",
                      workdir=str(tmp_path_factory.mktemp("four")), log_level="WARNING") as c:
        yield c


def tcp_sessions(cluster: LocalCluster, client) -> dict[str, int]:
    """Open data-plane connections on each server, as the server counts them."""
    out = {}
    for s in client.list_servers():
        channel = rpc.channel(s.grpc_address)
        try:
            stub = memory_server_pb2_grpc.MemoryServerStub(channel)
            out[s.server_id] = rpc.call(stub.Stats, memory_server_pb2.StatsRequest(), cluster.token, 5).sessions
        finally:
            channel.close()
    return out


def test_many_regions_share_connections_per_server(four):
    with four.client(transport="tcp", connections=CONNECTIONS, chunk_bytes=64 << 10) as c:
        names = [f"store/p{i}" for i in range(REGIONS)]
        regions = [c.create_region(n, 2 * MiB + 4096 * i, stripe_unit=64 << 10) for i, n in enumerate(names)]
        assert all(len({e.server_id for e in r.extents}) == SERVERS for r in regions)
        rng = np.random.default_rng(3)
        data = [rng.integers(0, 256, r.size, dtype=np.uint8) for r in regions]
        errors_seen: list[BaseException] = []

        def hammer(k: int) -> None:   # every region at once, many requests in flight per server
            try:
                for _ in range(3):
                    for r, d in zip(regions, data, strict=True):
                        r.write(0, d)
                        assert bytes(r.read()) == d.tobytes()
            except BaseException as exc:
                errors_seen.append(exc)

        threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        peak: dict[str, int] = {}
        while any(t.is_alive() for t in threads):
            for sid, n in tcp_sessions(four, c).items():
                peak[sid] = max(peak.get(sid, 0), n)
        for t in threads:
            t.join()
        assert not errors_seen, errors_seen[0]
        for sid, n in tcp_sessions(four, c).items():
            peak[sid] = max(peak.get(sid, 0), n)
        assert len(peak) == SERVERS
        assert all(1 <= n <= CONNECTIONS for n in peak.values()), peak
        assert len(c.open_sessions()) == SERVERS          # one session per endpoint
        for r, d in zip(regions, data, strict=True):
            assert np.array_equal(np.frombuffer(r.read(), np.uint8), d)
        for n in names:
            c.delete_region(n)


def test_shared_connection_keeps_each_regions_rights(four):
    with four.client(transport="tcp") as creator:
        a = creator.create_region("share/a", MiB, stripe_unit=64 << 10)
        a.write(0, b"A-original")
    with four.client(transport="tcp", connections=1) as c:   # one socket per server
        b = c.create_region("share/b", MiB, stripe_unit=64 << 10)
        b.write(0, b"B-written")                                # the connection now holds b's rw ticket
        ro = c.open_region("share/a", mode="ro")
        assert bytes(ro.read(0, 10)) == b"A-original"           # and a's ro ticket
        with pytest.raises(errors.ReadOnly):
            ro.write(0, b"changed")                             # the client refuses ...
        place = ro.extents[0]
        session = ro.route.session(place)
        assert session is b.route.session(next(e for e in b.extents if e.server_id == place.server_id))
        with pytest.raises(errors.ReadOnly):                    # ... and so does the server
            session.write(ro.route.ticket, place.extent_id, 0, [memoryview(b"changed")])
        with pytest.raises(errors.ReadOnly):                    # b's rw ticket lends nothing to a
            session.write(b.route.ticket, place.extent_id, 0, [memoryview(b"changed")])
        with pytest.raises(errors.ReadOnly):
            session.fetch_add(ro.route.ticket, place.extent_id, 0, 1)
        b.write(0, b"B-still-ok")
        assert bytes(b.read(0, 10)) == b"B-still-ok"
        assert bytes(ro.read(0, 10)) == b"A-original"
        c.delete_region("share/b")
    with four.client(transport="tcp") as creator:
        assert bytes(creator.open_region("share/a").read(0, 10)) == b"A-original"
        creator.delete_region("share/a")


def test_a_read_only_handle_takes_nothing_from_a_read_write_one_on_the_same_connection(four):
    """One client, one socket per server, the same region open read-write and read-only:
    presenting the read-only ticket once does not make the server refuse the read-write
    handle's writes (the server keeps a ticket per mode, not one per extent)."""
    with four.client(transport="tcp", connections=1) as c:
        rw = c.create_region("share/both", MiB, stripe_unit=64 << 10)
        rw.write(0, b"first")
        ro = c.open_region("share/both", mode="ro")
        assert bytes(ro.read(0, 5)) == b"first"                 # the ro ticket goes on the connection
        rw.write(0, b"later")                                   # and the rw one still writes
        assert rw.compare_swap(64, 0, 7) == 0
        assert bytes(ro.read(0, 5)) == b"later"
        with pytest.raises(errors.ReadOnly):
            ro.write(0, b"never")
        c.delete_region("share/both")


def test_shm_mapping_shared_by_read_only_and_read_write_handles(cluster, name):
    """One client, one region opened ro then rw: the extent's mapping is shared and made
    writable for the rw handle, and the ro handle still cannot write through it."""
    with cluster.client(transport="shm") as owner:
        owner.create_region(name, MiB, placement="single").write(0, b"original")
    with cluster.client(transport="shm") as c:
        ro = c.open_region(name, mode="ro")
        assert bytes(ro.read(0, 8)) == b"original"          # mapped read-only first
        rw = c.open_region(name)
        rw.write(0, b"written!")                             # remapped writable
        place = ro.extents[0]
        session = ro.route.session(place)
        assert session is rw.route.session(place) and session.scheme == "shm"
        with pytest.raises(errors.ReadOnly):
            session.write(ro.route.ticket, place.extent_id, 0, [memoryview(b"changed!")])
        assert bytes(ro.read(0, 8)) == b"written!"
        rw.accumulate(8, np.ones(2, np.float32))             # arithmetic over the shared tcp session
        assert list(ro.read(8, 8, dtype="float32")) == [1.0, 1.0]
        assert sorted(s.partition("://")[0] for s in c.open_sessions()) == ["shm", "tcp"]
        c.delete_region(name)


def test_regions_of_a_closed_client_raise_a_typed_error(cluster, name):
    c = cluster.client(transport="tcp")
    r = c.create_region(name, MiB, stripe_unit=64 << 10)
    r.write(0, b"before close")
    c.close()
    c.close()                                                # idempotent
    # Closed, not an Unavailable a retry policy would retry
    with pytest.raises(errors.Closed, match="closed"):
        r.read(0, MiB)                                       # several servers: the io pool path
    with pytest.raises(errors.Closed, match="closed"):
        r.fetch_add(0, 1)
    with pytest.raises(errors.Closed, match="closed"):
        r.write_async(0, b"x")
    with pytest.raises(errors.Closed, match="smb_client.connect"):
        c.open_region(name)
    with cluster.client() as other:
        assert bytes(other.open_region(name).read(0, 12)) == b"before close"
        other.delete_region(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_expired_ticket_is_renewed_and_the_operation_runs_again(cluster, name, transport):
    """A ticket that expires on a connection that already presented it, and one that is
    refused at HELLO: the region renews its ticket (a new token) and the operation runs."""
    secret = bytes.fromhex(cluster.secret_file.read_text().strip())
    with cluster.client(transport=transport, connections=1) as c:
        r = c.create_region(name, MiB, stripe_unit=64 << 10)
        r.write(0, b"payload!")
        ids = [e.extent_id for e in r.extents]
        r.route.expires_at = time.time() + 3600                   # skip the early renewal
        short, expires = tickets.sign(secret, r.uid, ids, "rw", ttl=2.0)
        r.route.ticket = short
        assert bytes(r.read(0, 8)) == b"payload!"            # presented while still valid
        assert r.route.ticket == short, "the short ticket expired before the first read; a slow host?"
        wait_until(lambda: time.time() > expires + 0.05, "the short ticket to expire", 10)
        r.accumulate(8, np.ones(4, np.float32))              # expired: renewed, run again
        assert r.route.ticket != short
        assert list(r.read(8, 16, dtype="float32")) == [1.0] * 4
        r.route.expires_at = time.time() + 3600
        r.route.ticket = tickets.sign(secret, r.uid, ids, "rw", ttl=-1)[0]   # refused at HELLO
        r.write(0, b"renewed!")
        assert bytes(r.read(0, 8)) == b"renewed!"
        c.delete_region(name)
