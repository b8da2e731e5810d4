"""Credentials and roles (pure): who a bearer credential proves to be."""
from __future__ import annotations

from smb_server.runtime.credentials import (
    ADMIN,
    CLIENT,
    INSECURE,
    SERVER,
    Credentials,
    Principal,
    admin_credential,
    server_credential,
)

SECRET = bytes(range(32))


def test_each_credential_proves_its_role():
    creds = Credentials("client-token", SECRET)
    assert creds.identify("client-token") == Principal(CLIENT)
    assert creds.identify(admin_credential(SECRET)) == Principal(ADMIN)
    assert creds.identify(server_credential(SECRET, "s1")) == Principal(SERVER, "s1")
    assert creds.identify(server_credential(SECRET, "a:b")) == Principal(SERVER, "a:b")


def test_forged_wrong_or_empty_credentials_prove_nothing():
    creds = Credentials("client-token", SECRET)
    other = bytes(32)
    good = server_credential(SECRET, "s1")
    for bad in ["", "client-token ", "server:", "server:s1:", server_credential(other, "s1"),
                admin_credential(other), "server:s2:" + good.rpartition(":")[2], good[:-1]]:
        assert creds.identify(bad) is None, bad
    assert Credentials("", SECRET).identify("") is None
    assert Credentials("t", b"").identify(admin_credential(b"")) is None
    assert Credentials("t", b"").identify(server_credential(b"", "s1")) is None


def test_separately_configured_admin_token():
    assert Credentials("t", SECRET, admin_token="ops").identify("ops") == Principal(ADMIN)


def test_what_each_role_may_do():
    client, admin, server = Principal(CLIENT), Principal(ADMIN), Principal(SERVER, "s1")
    assert client.has(CLIENT) and not client.has(SERVER) and not client.has(ADMIN)
    assert admin.has(CLIENT) and admin.has(ADMIN) and not admin.has(SERVER)
    assert server.has(SERVER) and not server.has(CLIENT) and not server.has(ADMIN)
    assert server.acts_for("s1") and not server.acts_for("s2") and not server.acts_for("")
    assert admin.acts_for("s2") and not client.acts_for("s1")
    assert all(INSECURE.has(r) for r in (CLIENT, SERVER, ADMIN)) and INSECURE.acts_for("any")
    assert str(server) == "server s1" and str(client) == "client"
