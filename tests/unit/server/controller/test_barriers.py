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


class _Generations:
    """A store of barrier generations that can be told to refuse (a deposed leader)."""

    def __init__(self) -> None:
        self.opened: dict[str, int] = {"b": 6}
        self.refuse = False

    def barrier_generation(self, name: str) -> int:
        return self.opened.get(name, 0)

    def open_barrier(self, name: str, generation: int) -> None:
        if self.refuse:
            raise errors.ControllerUnavailable("this controller no longer leads")
        assert generation == self.opened.get(name, 0) + 1
        self.opened[name] = generation


def _arrive(barriers: Barriers, n: int, out: list[object]) -> list[threading.Thread]:
    def one() -> None:
        try:
            out.append(barriers.wait("b", n + 1, timeout=30))
        except errors.SMBError as exc:
            out.append(exc)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _until_waiting(barriers: Barriers, n: int) -> None:
    deadline = time.monotonic() + 10
    with barriers._cond:  # noqa: SLF001  # the condition the waiters sit on
        while barriers._waiting < n:  # noqa: SLF001
            assert time.monotonic() < deadline
            barriers._cond.wait(0.01)  # noqa: SLF001


def test_generations_come_from_the_store_and_are_written_before_opening() -> None:
    store = _Generations()
    barriers = Barriers(store=store)
    out: list[object] = []
    threads = _arrive(barriers, 2, out)
    _until_waiting(barriers, 2)
    assert barriers.wait("b", 3) == (6, 2)
    for t in threads:
        t.join()
    assert sorted(out) == [(6, 0), (6, 1)] and store.opened["b"] == 7


def test_an_opening_the_store_refuses_fails_every_waiter() -> None:
    store = _Generations()
    barriers = Barriers(store=store)
    out: list[object] = []
    threads = _arrive(barriers, 2, out)
    _until_waiting(barriers, 2)
    store.refuse = True
    with pytest.raises(errors.ControllerUnavailable):
        barriers.wait("b", 3)
    for t in threads:
        t.join()
    assert all(isinstance(x, errors.ControllerUnavailable) for x in out) and len(out) == 2
    store.refuse = False   # the callers retry: all of them arrive again, in the same generation
    threads = _arrive(barriers, 2, out)
    _until_waiting(barriers, 2)
    assert barriers.wait("b", 3) == (6, 2)
    for t in threads:
        t.join()


def test_a_reset_fails_the_waiters_of_a_controller_that_stops_leading() -> None:
    barriers = Barriers(store=_Generations())
    out: list[object] = []
    threads = _arrive(barriers, 3, out)
    _until_waiting(barriers, 3)
    barriers.reset("no longer leads")
    for t in threads:
        t.join()
    assert len(out) == 3 and all(isinstance(x, errors.ControllerUnavailable) for x in out)
