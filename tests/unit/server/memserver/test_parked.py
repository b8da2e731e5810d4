"""Parked sums (smb_server/memserver/parked.py): taken by the round that completes,
reclaimed by a parker that saw the round complete first, handed back by the watchdog
when overdue; no thread or socket of a plane."""
from __future__ import annotations

import threading

import pytest

from smb_server.memserver.parked import Key, Parked


class Sum:
    def __init__(self, key: Key, overdue: bool = False) -> None:
        self.key = key
        self.due = overdue
        self.sent = 0
        self.back = threading.Event()

    def send(self) -> None:
        self.sent += 1

    def overdue(self) -> bool:
        return self.due

    def hand_back(self) -> None:
        self.back.set()


@pytest.fixture
def parked():
    table = Parked(recheck=0.01)
    yield table
    table.close()


def test_a_round_takes_its_own_sums_only(parked):
    a, b, other = Sum((1, 0, 4)), Sum((1, 0, 4)), Sum((1, 0, 5))
    for s in (a, b, other):
        parked.park(s)
    assert parked.take((1, 0, 4)) == [a, b]
    assert parked.take((1, 0, 4)) == []
    assert len(parked) == 1 and parked.take((1, 0, 5)) == [other]


def test_a_sum_is_reclaimed_once_and_never_after_its_round_took_it(parked):
    a, b = Sum((2, 8, 0)), Sum((2, 8, 0))
    parked.park(a)
    parked.park(b)
    assert parked.reclaim(a) and not parked.reclaim(a)
    assert parked.take((2, 8, 0)) == [b]
    assert not parked.reclaim(b)


def test_the_watchdog_hands_back_what_is_overdue_and_leaves_the_rest(parked):
    late, waiting = Sum((3, 0, 0), overdue=True), Sum((3, 0, 0))
    parked.park(late)
    parked.park(waiting)
    assert late.back.wait(5)
    assert not waiting.back.is_set() and parked.take((3, 0, 0)) == [waiting]


def test_a_sum_taken_by_its_round_is_not_handed_back_too(parked):
    """The watchdog and the completing push race for an overdue sum: one of them has it."""
    for _ in range(200):
        s = Sum((4, 0, 0), overdue=True)
        parked.park(s)
        taken = parked.take((4, 0, 0))
        got_back = s.back.wait(0.05) if not taken else s.back.is_set()
        assert (len(taken) == 1) != got_back


def test_a_watchdog_failure_does_not_stop_the_others(parked):
    class Broken(Sum):
        def overdue(self) -> bool:
            raise RuntimeError("boom")
    parked.park(Broken((5, 0, 0)))
    fine = Sum((5, 8, 0), overdue=True)
    parked.park(fine)
    assert fine.back.wait(5)
