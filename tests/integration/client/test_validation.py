"""CreateRegion input checks at the controller: every bad input is INVALID_ARGUMENT with
a message saying what is allowed, and nothing is created.

Requests go straight to the controller's gRPC service (so that the server's checks are
tested, whatever the Python client checks before sending); one test goes through the
client to see the typed error."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from smb_protocol import errors, rpc
from smb_protocol._proto.smb.v1 import controller_pb2, controller_pb2_grpc
from smb_protocol.names import MAX_NAME_LENGTH, check_region_name

MiB = 1 << 20


@pytest.fixture
def create(cluster) -> Iterator[Any]:
    """CreateRegion on the wire; returns the grpc.RpcError it raised."""
    channel = rpc.channel(cluster.address)
    stub = controller_pb2_grpc.ControllerStub(channel)

    def call(**fields: Any) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateRegion(controller_pb2.CreateRegionRequest(**fields),
                              metadata=rpc.auth_metadata(cluster.token), timeout=10)
        return info.value

    yield call
    channel.close()


@pytest.mark.parametrize("bad", ["..", ".", "../x", "x/..", "a/./b", "params", "/abs", "a//b",
                                 "job/" + "x" * MAX_NAME_LENGTH, "x/" + "y" * MiB])
def test_bad_region_names_are_invalid_argument(create, client, bad: str) -> None:
    error = create(name=bad, size=MiB)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "namespace/name" in error.details()
    assert all(r.name != bad for r in client.list_regions())


@pytest.mark.parametrize("field, value", [("size", 1 << 63), ("stripe_unit", 1 << 63),
                                          ("stripe_unit", (1 << 64) - 1)])
def test_sizes_beyond_int64_are_invalid_argument(create, name: str, field: str, value: int) -> None:
    fields = {"name": name, "size": MiB, field: value}
    error = create(**fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2^63-1" in error.details()


def test_layered_segment_beyond_int64_is_invalid_argument(create, name: str) -> None:
    error = create(name=name, size=MiB, placement="layered", segment_sizes=[1 << 63])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2^63-1" in error.details()


def test_client_maps_it_to_invalid_argument(client) -> None:
    with pytest.raises(errors.InvalidArgument):
        client.create_region("../etc", MiB)


def test_name_too_large_for_a_message_is_refused_before_sending() -> None:
    # a 70 MB name is larger than a gRPC message may be: it must be checked before sending
    with pytest.raises(errors.InvalidArgument, match="characters long"):
        check_region_name("job/" + "x" * (70 * 1000 * 1000))


def test_good_name_still_works(client, name: str) -> None:
    region = client.create_region(name, MiB)
    try:
        assert region.size == MiB
    finally:
        client.delete_region(name)
