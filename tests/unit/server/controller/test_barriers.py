"""Barrier waits are bounded overall and per caller (pure; no gRPC)."""
from __future__ import annotations

import threading
import time

import pytest

from smb_protocol import errors
from smb_server.controller.barriers import Barriers


def _waiting(b: Barriers, count: int, name: str, parties: int, caller: str) -> list[threading.Thread]:
    """Start ``count`` callers of ``name``; returns once they all wait."""
    target = b._waiting + count  # noqa: SLF001
    threads = [threading.Thread(target=b.wait, args=(name, parties, 5), kwargs={"caller": caller},
                                daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while b._waiting < target and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    return threads


def test_waits_beyond_the_limits_are_refused_but_the_opener_is_not() -> None:
    b = Barriers(max_waiters=3, max_per_caller=2)
    first = _waiting(b, 2, "job/a", 3, caller="p1")
    with pytest.raises(errors.ControllerBusy, match="this caller already waits in 2"):
        b.wait("job/other", 5, timeout=1, caller="p1")
    more = _waiting(b, 1, "job/b", 2, caller="p2")
    with pytest.raises(errors.ControllerBusy, match="3 callers wait"):
        b.wait("job/c", 5, timeout=1, caller="p3")
    assert b.wait("job/a", 3, timeout=1, caller="p3") == (0, 2)  # completes a barrier: never refused
    assert b.wait("job/b", 2, timeout=1, caller="p1") == (0, 1)
    for t in first + more:
        t.join(5)
    assert b._waiting == 0 and not b._by_caller  # noqa: SLF001
    b.close()
