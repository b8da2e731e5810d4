"""What a refused controller call tells its caller: the role it needs and where that
role's credential comes from."""
from __future__ import annotations

from smb_protocol import errors
from smb_server.runtime.credentials import ADMIN, CLIENT, SERVER, Principal
from smb_server.runtime.grpc_util import RoleAuth


def test_an_admin_call_by_a_client_names_the_admin_credential():
    exc = RoleAuth._refusal("DrainServer", (ADMIN,), Principal(CLIENT))
    assert isinstance(exc, errors.PermissionDenied)
    text = str(exc)
    assert "DrainServer needs the admin role" in text and "this caller is client" in text
    assert "SMB_ADMIN_TOKEN" in text


def test_a_client_call_by_a_server_names_the_client_token():
    exc = RoleAuth._refusal("CreateRegion", (CLIENT,), Principal(SERVER, server_id="s1"))
    assert "needs the client role" in str(exc) and "SMB_TOKEN" in str(exc)
    assert "SMB_ADMIN_TOKEN" not in str(exc)


def test_a_caller_with_the_role_goes_on():
    assert RoleAuth._refusal("DrainServer", (ADMIN,), Principal(ADMIN)) is None
