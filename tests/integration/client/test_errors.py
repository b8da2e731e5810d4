"""Bad input gets a typed error, the servers stay up, and other regions stay intact."""
from __future__ import annotations

import errno
import os
import socket

import numpy as np
import pytest

import smb_client
from smb_protocol import errors, wire
from smb_protocol.addressing import parse_endpoint
from smb_protocol.dtypes import DType

MiB = 1 << 20


@pytest.fixture
def witness(client, name):
    """A region whose content every test checks afterwards."""
    wname = name + "-witness"
    r = client.create_region(wname, 3 * MiB, stripe_unit=256 << 10)
    data = np.random.default_rng(7).integers(0, 256, 3 * MiB, dtype=np.uint8)
    r.write(0, data)
    yield r
    assert np.array_equal(np.frombuffer(r.read(), np.uint8), data), "another region changed"
    r.close()
    client.delete_region(wname)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_range_alignment_dtype_errors(cluster, witness, name, transport):
    with cluster.client(transport=transport) as c:
        r = c.create_region(name, MiB)
        with pytest.raises(errors.OutOfRange):
            r.write(MiB - 2, b"abc")
        with pytest.raises(errors.OutOfRange):
            r.read(-1, 4)
        with pytest.raises(errors.OutOfRange):
            r.read_into(MiB, bytearray(1))
        with pytest.raises(errors.InvalidArgument, match=r"dtype='float32'"):
            r.read(0, "float32")                             # the type where the length goes
        with pytest.raises(errors.InvalidArgument, match="whole numbers of bytes"):
            r.read(0, 2.5)
        with pytest.raises(errors.InvalidArgument, match="whole numbers of bytes"):
            r.write("0", b"abc")
        with pytest.raises(errors.Misaligned):
            r.accumulate(2, np.ones(4, np.float32))
        with pytest.raises(errors.Misaligned):
            r.accumulate(0, b"\0" * 6, dtype="float32")
        with pytest.raises(errors.DtypeError):
            r.accumulate(0, b"\0" * 8)                       # untyped bytes, no dtype
        with pytest.raises(errors.DtypeError):
            r.accumulate(0, np.ones(2, np.float32), dtype="int64")
        with pytest.raises(errors.DtypeError):
            r.accumulate(0, np.ones(2, np.uint8))
        with pytest.raises(errors.DtypeError):
            r.scale(0, 8, 2.0, "int32")
        with pytest.raises(errors.DtypeError):
            r.scale(0, 8, 2.0, "complex64")
        r.write(0, b"still works")
        assert bytes(r.read(0, 11)) == b"still works"
        c.delete_region(name)


def test_server_checks_bounds_too(cluster, client, witness, name):
    """Requests that skip the client's own checks are refused by the memory server."""
    r = client.create_region(name, MiB, placement="single")
    place = r.extents[0]
    s = r.route.session(place)
    with pytest.raises(errors.OutOfRange):
        s.write(r.route.ticket, place.extent_id, MiB - 1, [memoryview(b"xy")])
    with pytest.raises(errors.Misaligned):
        s.accumulate(r.route.ticket, place.extent_id, 3, [memoryview(b"\0" * 4)], DType.FLOAT32)
    with pytest.raises(errors.Misaligned):
        s.fetch_add(r.route.ticket, place.extent_id, 12, 1)
    with pytest.raises(errors.DtypeError):
        s.accumulate(r.route.ticket, place.extent_id, 0, [memoryview(b"\0" * 4)], 99)
    with cluster.client(transport="tcp") as other:   # a client that never saw the witness's ticket
        r2 = other.open_region(name)
        with pytest.raises(errors.InvalidTicket):
            r2.route.session(place).write(r2.route.ticket, witness.extents[0].extent_id, 0, [memoryview(b"steal")])
    r.write(0, b"ok")  # the session survived every refusal
    assert bytes(r.read(0, 2)) == b"ok"
    client.delete_region(name)


def test_unknown_region(client):
    with pytest.raises(errors.RegionNotFound):
        client.open_region("no/such-region")
    with pytest.raises(errors.RegionNotFound):
        client.delete_region("no/such-region")


def test_bad_names_and_sizes(client):
    with pytest.raises(errors.InvalidArgument):
        client.create_region("", 10)
    with pytest.raises(errors.InvalidArgument):
        client.create_region("bad//name", 10)
    with pytest.raises(errors.InvalidArgument):
        client.create_region("test/zero", 0)
    with pytest.raises(errors.InvalidArgument):
        client.create_region("test/p", 10, placement="diagonal")
    with pytest.raises(errors.InvalidArgument):
        client.open_region("no/such", mode="wx")
    # values protobuf cannot carry are typed errors that say what is allowed, not ValueError
    for size in (-5, 1 << 64, 2.5, "10", True):
        with pytest.raises(errors.InvalidArgument, match=r"size must be a whole number of bytes.*2\*\*63"):
            client.create_region("test/bad-size", size)
    with pytest.raises(errors.InvalidArgument, match="stripe_unit"):
        client.create_region("test/bad-unit", 4096, stripe_unit=-1)
    with pytest.raises(errors.InvalidArgument, match="num_servers"):
        client.create_region("test/bad-k", 4096, num_servers=-2)
    with pytest.raises(errors.InvalidArgument, match=r"segment_sizes\[1\]"):
        client.create_region("test/bad-seg", 4096, placement="layered", segment_sizes=[4000, -96])
    with pytest.raises(errors.InvalidArgument, match="admin"):
        client.open_region("no/such", mode="admin")


def test_region_exists(client, name):
    client.create_region(name, 4096).close()
    with pytest.raises(errors.RegionExists):
        client.create_region(name, 4096)
    same = client.create_region(name, 4096, exist_ok=True)
    assert same.size == 4096
    client.delete_region(name)


def test_out_of_memory_names_the_numbers(client, witness):
    with pytest.raises(errors.OutOfMemory) as info:
        client.create_region("test/huge", 64 << 30)
    message = str(info.value)
    assert "64.0 GiB" in message and "needs 32.0 GiB" in message and "free" in message, message
    assert not [r for r in client.list_regions() if r.name == "test/huge"]


def test_bad_token(cluster):
    with smb_client.connect(cluster.address, token="wrong") as c:
        with pytest.raises(errors.AuthenticationError):
            c.list_regions()
    with smb_client.connect(cluster.address, token="") as c:
        with pytest.raises(errors.AuthenticationError):
            c.create_region("test/no-token", 4096)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_read_only_ticket_cannot_write(cluster, client, name, transport):
    r = client.create_region(name, MiB)
    r.write(0, b"original")
    with cluster.client(transport=transport) as c:
        ro = c.open_region(name, mode="ro")
        assert bytes(ro.read(0, 8)) == b"original"
        with pytest.raises(errors.ReadOnly):
            ro.write(0, b"changed!")
        with pytest.raises(errors.ReadOnly):
            ro.accumulate(0, np.ones(2, np.float32))
        # the memory server refuses too, whatever the client library does
        place = ro.extents[0]
        with pytest.raises(errors.ReadOnly):
            ro.route.session(place).write(ro.route.ticket, place.extent_id, 0, [memoryview(b"changed!")])
        with pytest.raises(errors.ReadOnly):
            ro.route.session(place).fetch_add(ro.route.ticket, place.extent_id, 0, 1)
        ro.close()
    assert bytes(r.read(0, 8)) == b"original"
    client.delete_region(name)


def test_forged_ticket_is_refused(cluster, client, name):
    r = client.create_region(name, MiB)
    body, _, sig = r.route.ticket.partition(".")
    with cluster.client(transport="tcp") as c:
        r2 = c.open_region(name)
        r2.close()
        r2.route.ticket = body + "." + sig[::-1]
        with pytest.raises(errors.InvalidTicket):
            r2.write(0, b"x")
        r2.route.ticket = "garbage"
        with pytest.raises(errors.InvalidTicket):
            r2.read(0, 1)
    client.delete_region(name)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_deleted_region_cannot_be_used(cluster, client, name, transport):
    with cluster.client(transport=transport) as c:
        r = c.create_region(name, 2 * MiB)
        r.write(0, b"secret data")
        assert bytes(r.read(0, 11)) == b"secret data"  # sessions and mappings are open
        c.delete_region(name)
        with pytest.raises(errors.RegionNotFound):
            r.read(0, 11)
        with pytest.raises(errors.RegionNotFound):
            r.write(0, b"x")
        # a new region of the same name is other memory: the old handle stays locked out
        fresh = c.create_region(name, 2 * MiB)
        fresh.write(0, b"new owner")
        with pytest.raises(errors.RegionNotFound):
            r.read(0, 9)
        r.close()
        fresh.close()
        c.delete_region(name)


def test_garbage_on_the_data_port_closes_only_that_connection(client, witness, name):
    r = client.create_region(name, MiB)
    r.write(0, b"before")
    tcp = [u for u in r.extents[0].endpoints if u.startswith("tcp://")][0]
    ep = parse_endpoint(tcp)
    frames = [
        os.urandom(4096),                                        # random bytes
        wire.pack_request(wire.Op.HELLO, 1, length=100)[:20],     # truncated header
        wire.pack_request(wire.Op.HELLO, 1, length=1000) + b"x",  # truncated payload
        wire.pack_request(wire.Op.WRITE, 1, length=10),           # request before HELLO
        wire.pack_request(77, 1),                                  # unknown op
        wire.pack_request(wire.Op.HELLO, 1, length=1 << 40),       # absurd length
    ]
    for frame in frames:
        with socket.create_connection((ep.host, ep.port), timeout=5) as s:
            try:
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass  # the server may answer with an error, then must close
            except (ConnectionResetError, BrokenPipeError):
                pass      # it closed first: the same outcome
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    raise
    assert bytes(r.read(0, 6)) == b"before"
    r.write(0, b"after!")
    assert bytes(r.read(0, 6)) == b"after!"
    client.delete_region(name)
