"""Tickets: controller-signed capabilities checked by memory servers.

A ticket names a region (by uid), the extents it may touch, a mode and an expiry. Its
text form is ``base64url(json payload) + "." + base64url(HMAC-SHA256(secret, payload))``.
The controller signs with the cluster secret; memory servers verify with the same
secret. Clients treat tickets as opaque strings.

Modes: ``ro`` (read), ``rw`` (read and write), ``admin`` (the controller reserving or
releasing extents).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Iterable

from .errors import InvalidTicket, TicketExpired

MODES = ("ro", "rw", "admin")
DEFAULT_TTL = 3600.0  # seconds


@dataclass(frozen=True)
class Ticket:
    region_uid: str
    extent_ids: frozenset[int]
    mode: str
    expires_at: float  # unix seconds

    def allows(self, extent_id: int, write: bool = False) -> bool:
        if extent_id not in self.extent_ids:
            return False
        return not write or self.mode in ("rw", "admin")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: bytes, region_uid: str, extent_ids: Iterable[int], mode: str,
         ttl: float = DEFAULT_TTL, now: float | None = None) -> tuple[str, float]:
    """A signed ticket and its expiry (unix seconds)."""
    if mode not in MODES:
        raise ValueError(f"unknown ticket mode {mode!r}")
    expires = (time.time() if now is None else now) + ttl
    payload = json.dumps({"r": region_uid, "e": sorted(int(e) for e in extent_ids),
                          "m": mode, "x": round(expires, 3)}, separators=(",", ":")).encode()
    mac = hmac.new(secret, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}", expires


def verify(secret: bytes, token: str, now: float | None = None) -> Ticket:
    """Check the signature and expiry; raises InvalidTicket or TicketExpired."""
    try:
        body, _, sig = token.partition(".")
        payload, mac = _unb64(body), _unb64(sig)
    except (ValueError, TypeError):
        raise InvalidTicket("malformed ticket") from None
    if not hmac.compare_digest(mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise InvalidTicket("ticket signature does not verify (forged, or another cluster's secret)")
    try:
        data = json.loads(payload)
        ticket = Ticket(str(data["r"]), frozenset(int(e) for e in data["e"]), str(data["m"]),
                        float(data["x"]))
    except (ValueError, KeyError, TypeError):
        raise InvalidTicket("malformed ticket payload") from None
    if ticket.mode not in MODES:
        raise InvalidTicket(f"unknown ticket mode {ticket.mode!r}")
    if ticket.expires_at < (time.time() if now is None else now):
        raise TicketExpired("ticket expired; open the region again")
    return ticket
