"""Errors the transports share."""
from __future__ import annotations

from smb_protocol.errors import ServerUnavailable


class ConnectionBroken(ServerUnavailable):
    """The connection failed under a request (reset, closed): the server may be fine."""
