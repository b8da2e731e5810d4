"""`smb status` shows an evacuating server's progress (bytes moved, left, rate) and does
not list it as merely draining."""
from __future__ import annotations

from smb_server.commands.status import render

MiB = 1 << 20


def row(server_id: str, state: str, used: int, extents: int, **extra: object) -> dict[str, object]:
    return {"server_id": server_id, "state": state, "health": "SERVING", "address": "127.0.0.1:1",
            "capacity_bytes": 64 * MiB, "used_bytes": used, "extents": extents, "transports": ["tcp"],
            "heartbeat_age_seconds": 0.1, **extra}


def test_an_evacuating_server_shows_its_progress():
    status = {"controller": {"address": "127.0.0.1:7700", "health": "SERVING"}, "regions": [], "servers": [
        row("a", "draining", 6 * MiB, 3, evacuating=True, moved_bytes=10 * MiB, move_rate=5 * MiB),
        row("b", "draining", MiB, 1, evacuating=False, moved_bytes=0, move_rate=0.0),
        row("c", "up", 20 * MiB, 5)]}
    text = render(status)
    assert "evacuating a: 10.0 MiB moved, 6.0 MiB in 3 extent(s) left, 5.0 MiB/s" in text
    assert "draining (no new extents): b" in text
