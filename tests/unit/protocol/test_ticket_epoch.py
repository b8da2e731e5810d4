"""Tickets carry the signing controller's leader epoch."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json

from smb_protocol import tickets

SECRET = b"k" * 32


def test_epoch_travels_in_the_signed_ticket() -> None:
    token, _ = tickets.sign(SECRET, "uid", [7], "admin", epoch=12)
    assert tickets.verify(SECRET, token).epoch == 12
    token, _ = tickets.sign(SECRET, "uid", [7], "rw")
    assert tickets.verify(SECRET, token).epoch == 0


def test_a_ticket_without_an_epoch_reads_as_epoch_0() -> None:
    payload = json.dumps({"r": "uid", "e": [7], "m": "admin", "x": 4e9}).encode()
    mac = hmac.new(SECRET, payload, hashlib.sha256).digest()

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    ticket = tickets.verify(SECRET, f"{b64(payload)}.{b64(mac)}")
    assert ticket.epoch == 0 and ticket.extent_ids == frozenset({7})
