"""Credentials are checked from a call's metadata before its body is parsed, on the
controller and on the memory servers' gRPC service: undecodable bytes with a missing or
wrong credential are refused with UNAUTHENTICATED (PERMISSION_DENIED for the wrong role),
never answered with a deserialization failure, and the daemons keep serving."""
from __future__ import annotations

import random

import grpc
import pytest

from smb_protocol import rpc

GARBAGE = b"\xff\xff\xff\xff\x0f"   # field 0 (invalid) with wire type 7 (invalid): never decodes
TIMEOUT = 10.0
RANDOM_CALLS = 250


def raw_call(address: str, method: str, body: bytes, token: str | None) -> grpc.StatusCode:
    """Send ``body`` as the request of ``method`` with no serializer at all; the status
    the daemon answered with (OK when it answered)."""
    with rpc.channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(body, metadata=rpc.auth_metadata(token), timeout=TIMEOUT)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_controller_refuses_garbage_with_a_wrong_credential_before_parsing_it(cluster):
    address = cluster.address
    for token in ("wrong-token", None, ""):
        for method in ("CreateRegion", "RegisterServer", "DrainServer", "Barrier"):
            code = raw_call(address, f"/smb.v1.Controller/{method}", GARBAGE, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, token, code)
    rng = random.Random(21)
    codes = {raw_call(address, "/smb.v1.Controller/CreateRegion",
                      rng.randbytes(rng.randrange(1, 200)), "wrong-token")
             for _ in range(RANDOM_CALLS)}
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}
    # the client role may not register a server: refused for its role, body unread
    code = raw_call(address, "/smb.v1.Controller/RegisterServer", GARBAGE, cluster.token)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # the right credential with garbage: the body is parsed, and refused
    code = raw_call(address, "/smb.v1.Controller/CreateRegion", GARBAGE, cluster.token)
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    with cluster.client() as c:                      # still serving
        assert len(c.list_servers()) == cluster.num_servers


def test_memory_server_refuses_garbage_with_a_wrong_credential_before_parsing_it(cluster):
    with cluster.client() as c:
        address = c.list_servers()[0].grpc_address
    for token in ("wrong-token", None):
        code = raw_call(address, "/smb.v1.MemoryServer/Stats", GARBAGE, token)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (token, code)
    code = raw_call(address, "/smb.v1.MemoryServer/Stats", b"", cluster.token)
    assert code == grpc.StatusCode.OK
    # methods that check a ticket in their body may come without a credential, but a
    # wrong one is refused before the body is parsed
    for method in ("ReserveExtent", "ReleaseExtent", "Connect", "ConfigureReplicas"):
        code = raw_call(address, f"/smb.v1.MemoryServer/{method}", GARBAGE, "wrong-token")
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code)
    code = raw_call(address, "/smb.v1.MemoryServer/ReserveExtent", GARBAGE, None)
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_the_refusal_names_what_to_fix(cluster, token):
    with rpc.channel(cluster.address) as channel:
        call = channel.unary_unary("/smb.v1.Controller/ListRegions", request_serializer=None,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(GARBAGE, metadata=rpc.auth_metadata(token), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "SMB_TOKEN" in info.value.details()
