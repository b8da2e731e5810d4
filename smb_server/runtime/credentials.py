"""Who is calling the controller: credentials, roles and the principal they prove.

Three roles (see the "Security" section of docs/operations.md):

- ``client``: the cluster's bearer token; regions, data, barriers, listings;
- ``server``: a memory server; it presents ``server:<server_id>:<mac>`` where ``mac``
  is ``HMAC-SHA256(secret, "server:" + server_id)`` in hex, and may register,
  heartbeat and unregister that one server only;
- ``admin``: ``admin:<HMAC-SHA256(secret, "admin")>`` in hex, or the token in the
  controller's ``admin_token_file``; everything a client may do, plus drain, undrain
  and remove any server.

Pure: no gRPC. The secret is the ticket secret the controller and the memory servers
already share; nothing new has to be distributed to the servers.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

CLIENT = "client"
SERVER = "server"
ADMIN = "admin"
ROLES = (CLIENT, SERVER, ADMIN)

_SERVER_PREFIX = "server:"
_ADMIN_PREFIX = "admin:"


def _mac(secret: bytes, label: str) -> str:
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()


def server_credential(secret: bytes, server_id: str) -> str:
    """The bearer credential of memory server ``server_id`` (derived from ``secret``)."""
    return f"{_SERVER_PREFIX}{server_id}:{_mac(secret, _SERVER_PREFIX + server_id)}"


def admin_credential(secret: bytes) -> str:
    """The operator's bearer credential derived from ``secret``."""
    return _ADMIN_PREFIX + _mac(secret, "admin")


@dataclass(frozen=True)
class Principal:
    """A caller whose credential checked out: its role and, for a server, its id.
    ``insecure``: authentication is off and the caller may do anything."""

    role: str
    server_id: str = ""
    insecure: bool = False

    def has(self, role: str) -> bool:
        """True when this caller may make calls that need ``role`` (admin includes client)."""
        return self.insecure or self.role == role or (self.role == ADMIN and role == CLIENT)

    def acts_for(self, server_id: str) -> bool:
        """True when this caller may speak for memory server ``server_id``."""
        return self.insecure or self.role == ADMIN or (self.role == SERVER and self.server_id == server_id)

    def __str__(self) -> str:
        return f"server {self.server_id}" if self.role == SERVER else self.role


INSECURE = Principal(ADMIN, insecure=True)


class Credentials:
    """Checks bearer credentials. ``token``: the clients' token; ``secret``: the shared
    secret servers' and the derived admin credential come from; ``admin_token``: a
    further admin credential (optional). Empty values match nothing."""

    def __init__(self, token: str, secret: bytes, admin_token: str = "") -> None:
        self._token = token.encode()
        self._secret = secret
        self._admins = [a.encode() for a in (admin_credential(secret) if secret else "", admin_token) if a]

    def identify(self, credential: str) -> Principal | None:
        """The principal ``credential`` proves, or None."""
        given = credential.encode()
        if credential.startswith(_SERVER_PREFIX) and self._secret:
            server_id = credential[len(_SERVER_PREFIX):].rpartition(":")[0]
            if server_id and hmac.compare_digest(given, server_credential(self._secret, server_id).encode()):
                return Principal(SERVER, server_id)
            return None
        if any(hmac.compare_digest(given, a) for a in self._admins):
            return Principal(ADMIN)
        if self._token and hmac.compare_digest(given, self._token):
            return Principal(CLIENT)
        return None
