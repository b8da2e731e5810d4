"""CreateRegion input checks at the controller: every bad input is InvalidArgument
(gRPC INVALID_ARGUMENT) with a message saying what is allowed, and nothing is created."""
from __future__ import annotations

import grpc
import pytest

from smb_client import errors, rpc
from smb_client._proto.smb.v1 import controller_pb2, controller_pb2_grpc
from smb_client.names import MAX_NAME_LENGTH, check_region_name

MiB = 1 << 20


@pytest.mark.parametrize("bad", ["..", ".", "../x", "x/..", "a/./b", "params", "/abs", "a//b",
                                 "job/" + "x" * MAX_NAME_LENGTH, "x/" + "y" * MiB])
def test_bad_region_names_are_invalid_argument(client, bad: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="namespace/name"):
        client.create_region(bad, MiB)
    assert all(r.name != bad for r in client.list_regions())


@pytest.mark.parametrize("field, value", [("size", 1 << 63), ("stripe_unit", 1 << 63),
                                          ("stripe_unit", (1 << 64) - 1)])
def test_sizes_beyond_int64_are_invalid_argument(client, name: str, field: str, value: int) -> None:
    kwargs = {"size": MiB, field: value}
    with pytest.raises(errors.InvalidArgument, match=r"2\^63-1"):
        client.create_region(name, **kwargs)


def test_status_code_is_invalid_argument(cluster, name: str) -> None:
    """The wire code itself, for clients in other languages."""
    channel = rpc.channel(cluster.address)
    try:
        stub = controller_pb2_grpc.ControllerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateRegion(controller_pb2.CreateRegionRequest(name="../etc", size=MiB),
                              metadata=[("authorization", f"Bearer {cluster.token}")], timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "namespace/name" in info.value.details()
    finally:
        channel.close()


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
