"""Addresses, sizes, error mapping, buffer views and transport choice (no network)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from smb_client.buffers import as_view
from smb_client.client import Client
from smb_client.dataplane import DataPlane, choose_endpoint
from smb_protocol import errors
from smb_protocol.addressing import parse_endpoint, parse_hostport
from smb_protocol.dtypes import DType, resolve
from smb_protocol.placement import ExtentPlace
from smb_protocol.retry import Retry
from smb_protocol.units import format_bytes, parse_size


def test_endpoints():
    assert parse_endpoint("tcp://10.0.0.1:7701").port == 7701
    assert parse_endpoint("tcp://[::1]:9").host == "::1"
    assert parse_endpoint("shm:///run/smb/a.sock").path == "/run/smb/a.sock"
    assert str(parse_endpoint("tcp://h:1")) == "tcp://h:1"
    with pytest.raises(errors.InvalidArgument, match="tcp://, shm://, rdma://"):
        parse_endpoint("udp://h:1")
    with pytest.raises(errors.InvalidArgument):
        parse_endpoint("shm://relative")
    with pytest.raises(errors.InvalidArgument):
        parse_hostport("h:notaport")
    with pytest.raises(errors.InvalidArgument):
        parse_hostport("h:70000")
    assert parse_hostport("h", default_port=5) == ("h", 5)


def test_sizes():
    assert parse_size("4096") == 4096
    assert parse_size("64K") == 64 << 10
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2MiB") == 2 << 20
    with pytest.raises(errors.InvalidArgument):
        parse_size("lots")
    assert format_bytes(3 << 20) == "3.0 MiB"


def test_error_tree_and_status_codes():
    assert issubclass(errors.ExtentNotFound, errors.RegionNotFound)
    assert issubclass(errors.OutOfRange, ValueError)
    for status in errors.Status:
        if status is errors.Status.OK:
            continue
        exc = errors.status_error(status, "m")
        assert errors.error_status(exc) == status
    assert isinstance(errors.status_error(250, "?"), errors.ServerError)
    assert errors.error_class("NoSuchThing") is errors.ServerError


def test_dtype_resolution():
    assert resolve("float32") is DType.FLOAT32
    assert resolve(np.float16) is DType.FLOAT16
    assert resolve(torch.bfloat16) is DType.BFLOAT16
    assert resolve(np.dtype("int64")) is DType.INT64
    with pytest.raises(errors.DtypeError):
        resolve("complex64")
    with pytest.raises(errors.DtypeError):
        resolve(None)


def test_buffer_views_share_memory():
    a = np.arange(10, dtype=np.float32)
    view, dt = as_view(a, writable=True)
    assert dt is DType.FLOAT32 and len(view) == 40
    view[0:4] = b"\0\0\x80\x3f"  # 1.0f
    assert a[0] == 1.0
    t = torch.zeros(4, dtype=torch.bfloat16)
    view, dt = as_view(t, writable=True)
    assert dt is DType.BFLOAT16 and len(view) == 8
    view[0:2] = b"\x80\x3f"
    assert t[0].item() == 1.0
    assert as_view(b"abc")[1] is None
    with pytest.raises(errors.InvalidArgument):
        as_view(b"abc", writable=True)
    with pytest.raises(errors.InvalidArgument):
        as_view(np.arange(10)[::2], writable=True)
    with pytest.raises(errors.InvalidArgument):
        as_view(object())
    assert len(as_view(np.arange(10, dtype=np.int64)[::2])[0]) == 40  # copied once


def test_transport_choice():
    place = ExtentPlace(1, "s1", 10, "h:1", "hostA", ("tcp://h:2", "shm:///x.sock"), "up")
    assert choose_endpoint(place, "auto", "hostA") == "shm:///x.sock"
    assert choose_endpoint(place, "auto", "hostB") == "tcp://h:2"
    assert choose_endpoint(place, "tcp", "hostA") == "tcp://h:2"
    with pytest.raises(errors.InvalidArgument, match="offers shm, tcp"):
        choose_endpoint(place, "rdma", "hostA")
    with pytest.raises(errors.InvalidArgument):
        choose_endpoint(place, "shm", "hostB")
    with pytest.raises(errors.InvalidArgument, match="unknown transport"):
        Client("127.0.0.1:1", transport="carrier-pigeon")


def test_dataplane_arguments_and_lifecycle():
    with pytest.raises(errors.InvalidArgument, match="connections"):
        DataPlane("tcp", "hostA", connections=0)
    with pytest.raises(errors.InvalidArgument, match="unknown transport"):
        DataPlane("udp", "hostA")
    with pytest.raises(errors.InvalidArgument, match="chunk_bytes"):
        Client("127.0.0.1:1", chunk_bytes=0)
    dp = DataPlane("tcp", "hostA", connections=1)
    assert dp.run([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    assert dp.submit(lambda x: x * 2, 21).result(timeout=5) == 42
    place = ExtentPlace(1, "s1", 10, "h:1", "hostA", ("tcp://127.0.0.1:1",), "up")
    session = dp.session(place)
    assert dp.session(place) is session and list(dp.sessions()) == ["tcp://127.0.0.1:1"]
    dp.close()
    dp.close()
    # use after close is the caller's mistake: Closed, which no retry policy of
    # Unavailable retries
    with pytest.raises(errors.Closed, match="closed"):
        dp.session(place)
    with pytest.raises(errors.Closed, match="closed"):
        dp.run([lambda: 1])
    with pytest.raises(errors.Closed, match="closed"):
        dp.submit(lambda: 1)
    with pytest.raises(errors.ServerUnavailable):       # the session's pool was closed too
        session.read_into("t", 1, 0, [memoryview(bytearray(8))])


def test_closed_client_refuses_controller_calls_with_a_typed_error():
    c = Client("127.0.0.1:1", reconnect_timeout=30.0)
    c.close()
    with pytest.raises(errors.Closed, match="closed") as info:   # at once, no retrying
        c.list_regions()
    assert not isinstance(info.value, errors.Unavailable)
    assert "smb_client.connect" in str(info.value)
    tries = []

    def call():
        tries.append(1)
        return c.list_regions()
    with pytest.raises(errors.Closed):   # the retry policy the docs suggest gives up at once
        Retry(on=(errors.Unavailable, errors.Timeout), timeout=30.0)(call, what="list")
    assert len(tries) == 1


@pytest.mark.parametrize("name", ["x" * (70 << 20), "a/" + "b" * 300, "..", ".", "../x",
                                  "params", "job//p", "job/.."])
def test_region_names_checked_before_any_call(name):
    # no controller listens here: the name is refused before the request is built,
    # including one too large for a gRPC message (which the controller never sees)
    with Client("127.0.0.1:1", "t", reconnect_timeout=0.0) as c:
        with pytest.raises(errors.InvalidArgument, match="namespace/name"):
            c.create_region(name, 4096)
        with pytest.raises(errors.InvalidArgument, match="namespace/name"):
            c.open_region(name)
