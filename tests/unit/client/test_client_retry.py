"""The client's retry schedule for an unreachable controller (a leader killed, its
standby taking over): every controller of the list is tried before the client waits."""
from __future__ import annotations

from typing import Any

import pytest

from smb_client.client import RECONNECT_CAP, RECONNECT_FIRST, Client, reconnect_backoff
from smb_protocol.errors import ControllerUnavailable


def test_over_three_controllers_only_a_whole_round_waits() -> None:
    b = reconnect_backoff(3)
    delays = [b.next_delay() for _ in range(30)]
    assert delays[:6] == pytest.approx([0, 0, RECONNECT_FIRST, 0, 0, 2 * RECONNECT_FIRST])
    assert all(d == 0 for i, d in enumerate(delays) if i % 3 != 2)
    assert max(delays) == pytest.approx(RECONNECT_CAP)
    # a standby that starts to lead is reached within one wait and one round of the list
    assert RECONNECT_CAP <= 0.25


def test_a_lone_controller_waits_after_every_try() -> None:
    b = reconnect_backoff(1)
    assert [b.next_delay() for _ in range(3)] == pytest.approx([RECONNECT_FIRST, 2 * RECONNECT_FIRST,
                                                                4 * RECONNECT_FIRST])


def test_a_call_moves_through_the_list_to_the_new_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[str] = []
    c = Client("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", reconnect_timeout=5.0)
    try:
        def call_once(method: str, request: Any, deadline: float | None) -> str:
            address = c.controllers[c._leader]
            tried.append(address)
            if address != "127.0.0.1:3" or len(tried) < 6:   # the third leads from its second round
                c._leader = (c._leader + 1) % len(c.controllers)
                raise ControllerUnavailable(f"{address} stands by")
            return "answer"
        monkeypatch.setattr(c, "_call_once", call_once)
        assert c._call("ListRegions", None) == "answer"
        assert tried == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"] * 2
    finally:
        c.close()
