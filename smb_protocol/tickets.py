"""Tickets: controller-signed capabilities checked by memory servers.

A ticket names a region (by uid), the extents it may touch, a mode and an expiry. Its
text form is ``base64url(json payload) + "." + base64url(HMAC-SHA256(secret, payload))``.
The controller signs with the cluster secret; memory servers verify with the same
secret. Clients treat tickets as opaque strings.

Modes: ``ro`` (read), ``rw`` (read and write), ``admin`` (the controller reserving or
releasing extents), ``replica`` (a primary memory server forwarding the mutations of a
replicated extent to a backup copy; memory servers sign these with the shared secret,
and a ticket's ``view`` names the replica-set version it was signed for).

A ticket may carry the signing controller's leader epoch (``epoch``, 0 when there is no
election); memory servers refuse admin tickets of an epoch older than one they have
seen, so that a deposed leader cannot reserve or release extents.
"""
from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidTicket, TicketExpired


class TicketMode(enum.StrEnum):
    """What a ticket allows. A ``str`` enum: it compares equal to its text form and
    travels as that text in tickets, protobuf fields and wire frames."""

    RO = "ro"          # read
    RW = "rw"          # read and write
    ADMIN = "admin"    # the controller reserving or releasing extents
    REPLICA = "replica"  # a primary memory server forwarding mutations to a backup copy

    @property
    def writes(self) -> bool:
        return self is not TicketMode.RO

    @classmethod
    def parse(cls, text: str) -> TicketMode:
        """The mode named ``text``; ValueError naming the known modes otherwise."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown ticket mode {text!r}: expected one of "
                             + ", ".join(m.value for m in cls)) from None


MODES = tuple(m.value for m in TicketMode)
DEFAULT_TTL = 3600.0  # seconds


@dataclass(frozen=True)
class Ticket:
    region_uid: str
    extent_ids: frozenset[int]
    mode: TicketMode
    expires_at: float  # unix seconds
    epoch: int = 0     # the signing controller's leader epoch (0: no election)
    view: int = 0      # replica tickets: the replica-set version of the signing primary

    def allows(self, extent_id: int, write: bool = False) -> bool:
        if extent_id not in self.extent_ids:
            return False
        return not write or self.mode.writes


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: bytes, region_uid: str, extent_ids: Iterable[int], mode: str | TicketMode,
         ttl: float = DEFAULT_TTL, now: float | None = None, epoch: int = 0,
         view: int = 0) -> tuple[str, float]:
    """A signed ticket and its expiry (unix seconds); ``epoch``: the leader epoch;
    ``view``: the replica-set version (replica tickets)."""
    mode = TicketMode.parse(mode)
    expires = (time.time() if now is None else now) + ttl
    fields: dict[str, object] = {"r": region_uid, "e": sorted(int(e) for e in extent_ids),
                                 "m": mode.value, "x": round(expires, 3)}
    if epoch:
        fields["p"] = int(epoch)
    if view:
        fields["v"] = int(view)
    payload = json.dumps(fields, separators=(",", ":")).encode()
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
        mode = TicketMode.parse(str(data["m"]))
    except ValueError as exc:
        raise InvalidTicket(str(exc)) from None
    except (KeyError, TypeError):
        raise InvalidTicket("malformed ticket payload") from None
    try:
        ticket = Ticket(str(data["r"]), frozenset(int(e) for e in data["e"]), mode, float(data["x"]),
                        int(data.get("p", 0)), int(data.get("v", 0)))
    except (ValueError, KeyError, TypeError):
        raise InvalidTicket("malformed ticket payload") from None
    if ticket.expires_at < (time.time() if now is None else now):
        raise TicketExpired("ticket expired; open the region again")
    return ticket
