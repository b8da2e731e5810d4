"""Tickets: signing, verification, forgery, expiry and modes (smb_protocol.tickets)."""
from __future__ import annotations

import base64
import json

import pytest

from smb_protocol import errors, tickets

SECRET = b"k" * 32


def test_sign_verify_round_trip() -> None:
    token, expires = tickets.sign(SECRET, "uid1", [3, 1, 2], "rw", ttl=10, now=1000.0)
    assert expires == 1010.0
    t = tickets.verify(SECRET, token, now=1005.0)
    assert t.region_uid == "uid1" and t.extent_ids == {1, 2, 3} and t.mode == "rw"
    assert t.expires_at == pytest.approx(1010.0)


def test_forged_payload_is_refused() -> None:
    token, _ = tickets.sign(SECRET, "uid1", [1], "ro", now=1000.0)
    body, sig = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    payload["m"] = "rw"  # try to upgrade the mode
    forged_body = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    with pytest.raises(errors.InvalidTicket, match="signature"):
        tickets.verify(SECRET, f"{forged_body}.{sig}", now=1000.0)


@pytest.mark.parametrize("token", ["", "garbage", "a.b", "!!!.???"])
def test_malformed_is_refused(token: str) -> None:
    with pytest.raises(errors.InvalidTicket):
        tickets.verify(SECRET, token)


def test_expired() -> None:
    token, _ = tickets.sign(SECRET, "uid1", [1], "rw", ttl=5, now=1000.0)
    with pytest.raises(errors.TicketExpired):
        tickets.verify(SECRET, token, now=1006.0)
    assert issubclass(errors.TicketExpired, errors.PermissionDenied)


def test_wrong_secret() -> None:
    token, _ = tickets.sign(SECRET, "uid1", [1], "rw")
    with pytest.raises(errors.InvalidTicket):
        tickets.verify(b"other" * 8, token)


def test_modes_allow() -> None:
    ro = tickets.verify(SECRET, tickets.sign(SECRET, "u", [7], "ro")[0])
    rw = tickets.verify(SECRET, tickets.sign(SECRET, "u", [7], "rw")[0])
    admin = tickets.verify(SECRET, tickets.sign(SECRET, "u", [7], "admin")[0])
    assert ro.allows(7) and not ro.allows(7, write=True)
    assert rw.allows(7) and rw.allows(7, write=True)
    assert admin.allows(7, write=True)
    assert not rw.allows(8) and not rw.allows(8, write=True)


def test_unknown_mode_cannot_be_signed() -> None:
    with pytest.raises(ValueError):
        tickets.sign(SECRET, "u", [1], "root")
