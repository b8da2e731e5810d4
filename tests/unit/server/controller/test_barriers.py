"""Barrier waits are bounded overall and per caller (pure; no gRPC)."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from smb_protocol import errors
from smb_server.controller.barriers import Barriers


def _waiting(b: Barriers, count: int, name: str, parties: int, caller: str = "",
             ranks: Sequence[int | None] = ()) -> list[threading.Thread]:
    """Start ``count`` callers of ``name`` (``ranks``: theirs, one each, when given);
    returns once they all wait. A caller whose wait times out (5 s) or is woken by
    :meth:`Barriers.close` ends quietly."""
    target = b._waiting + count  # noqa: SLF001
    threads = [threading.Thread(target=_wait_quietly, args=(b, name, parties, caller, ranks[i] if ranks else None),
                                daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    _until_waiting(b, target)
    return threads


def _wait_quietly(b: Barriers, name: str, parties: int, caller: str, rank: int | None) -> None:
    try:
        b.wait(name, parties, 5, caller=caller, rank=rank)
    except (errors.BarrierTimeout, errors.ControllerUnavailable):
        pass


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
        self.arrivals: dict[str, tuple[str, ...]] = {}
        self.refuse = False

    def barrier_generation(self, name: str) -> tuple[int, tuple[str, ...]]:
        return self.opened.get(name, 0), self.arrivals.get(name, ())

    def open_barrier(self, name: str, generation: int, arrivals: Sequence[str]) -> None:
        if self.refuse:
            raise errors.ControllerUnavailable("this controller no longer leads")
        assert generation == self.opened.get(name, 0) + 1
        self.opened[name] = generation
        self.arrivals[name] = tuple(arrivals)


def _arrive(barriers: Barriers, n: int, out: list[object]) -> list[threading.Thread]:
    """Start ``n`` callers of barrier "b" of ``n + 1`` parties, each adding what its wait
    returned or raised to ``out``; returns once they all wait."""
    target = barriers._waiting + n  # noqa: SLF001

    def one() -> None:
        try:
            out.append(barriers.wait("b", n + 1, timeout=30))
        except errors.SMBError as exc:
            out.append(exc)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    _until_waiting(barriers, target)
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
    assert barriers.wait("b", 3) == (6, 2)
    for t in threads:
        t.join()
    assert sorted(out) == [(6, 0), (6, 1)] and store.opened["b"] == 7


def test_an_opening_the_store_refuses_fails_every_waiter() -> None:
    store = _Generations()
    barriers = Barriers(store=store)
    out: list[object] = []
    threads = _arrive(barriers, 2, out)
    store.refuse = True
    with pytest.raises(errors.ControllerUnavailable):
        barriers.wait("b", 3)
    for t in threads:
        t.join()
    assert all(isinstance(x, errors.ControllerUnavailable) for x in out) and len(out) == 2
    store.refuse = False   # the callers retry: all of them arrive again, in the same generation
    threads = _arrive(barriers, 2, out)
    assert barriers.wait("b", 3) == (6, 2)
    for t in threads:
        t.join()


def test_a_reset_fails_the_waiters_of_a_controller_that_stops_leading() -> None:
    barriers = Barriers(store=_Generations())
    out: list[object] = []
    threads = _arrive(barriers, 3, out)
    barriers.reset("no longer leads")
    for t in threads:
        t.join()
    assert len(out) == 3 and all(isinstance(x, errors.ControllerUnavailable) for x in out)


def _ids(n: int) -> list[str]:
    return [f"{k:032x}" for k in range(1, n + 1)]


def test_an_arrival_whose_reply_was_lost_is_answered_at_a_new_leader_and_not_counted_again() -> None:
    store = _Generations()
    old = Barriers(store=store)
    a, b = _ids(2)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(old.wait("b", 2, timeout=30, arrival_id=a)))
    waiter.start()
    _until_waiting(old, 1)
    assert old.wait("b", 2, arrival_id=b) == (6, 1)    # opens generation 6 (its reply is lost)
    waiter.join()
    assert got == [(6, 0)] and store.arrivals["b"] == (a, b)
    new = Barriers(store=store)                        # the leader dies; b retries at the next
    assert new.wait("b", 2, arrival_id=b) == (6, 1)    # at once: the opening it took part in
    # the retry was not counted in generation 7: a alone does not open it
    out: list[object] = []
    second = threading.Thread(target=lambda: out.append(new.wait("b", 2, timeout=30, arrival_id=_ids(3)[2])))
    second.start()
    _until_waiting(new, 1)
    assert new.wait("b", 2, arrival_id=b) == (6, 1)    # retried again meanwhile: still not counted
    assert new._waiting == 1  # noqa: SLF001
    assert new.wait("b", 2, arrival_id="f" * 32) == (7, 1)
    second.join()
    assert out == [(7, 0)]


def test_a_retry_of_an_arrival_still_waiting_takes_its_place() -> None:
    barriers = Barriers()                              # SQLite: arrivals in memory only
    a, b = _ids(2)
    out: list[object] = []

    def first() -> None:
        try:
            out.append(barriers.wait("b", 2, timeout=30, arrival_id=a))
        except errors.SMBError as exc:
            out.append(exc)
    gone = threading.Thread(target=first)
    gone.start()
    _until_waiting(barriers, 1)
    retry = threading.Thread(target=lambda: out.append(barriers.wait("b", 2, timeout=30, arrival_id=a)))
    retry.start()
    gone.join()                                       # the first call gives way to its retry
    assert len(out) == 1 and isinstance(out[0], errors.ControllerUnavailable)
    _until_waiting(barriers, 1)
    assert barriers.wait("b", 2, arrival_id=b) == (0, 1)   # two arrivals, not three
    retry.join()
    assert out[1:] == [(0, 0)]
    assert barriers.wait("b", 2, arrival_id=b) == (0, 1)   # b's retry after the opening
    with pytest.raises(errors.InvalidArgument, match="arrival id"):
        barriers.wait("b", 2, arrival_id="not-an-id")


def test_a_caller_that_gives_up_takes_only_itself_out() -> None:
    """Two callers without arrival ids look alike; the one that times out leaves, the
    other stays counted and is released when the barrier opens."""
    b = Barriers()
    got: dict[str, object] = {}

    def call(who: str, timeout: float) -> None:
        try:
            got[who] = b.wait("job/x", 3, timeout=timeout)
        except errors.SMBError as exc:
            got[who] = exc
    stays = threading.Thread(target=call, args=("stays", 30))
    stays.start()
    _until_waiting(b, 1)
    leaves = threading.Thread(target=call, args=("leaves", 0.05))
    leaves.start()
    leaves.join(10)
    assert isinstance(got["leaves"], errors.BarrierTimeout)
    third = threading.Thread(target=call, args=("third", 30))
    third.start()
    _until_waiting(b, 2)
    assert b.wait("job/x", 3, timeout=5) == (0, 2)    # the one that stays counts, the one that left not
    stays.join(10)
    third.join(10)
    assert (got["stays"], got["third"]) == ((0, 0), (0, 1))
    b.close()


def test_a_timeout_names_the_ranks_that_did_not_come() -> None:
    b = Barriers()
    waiting = _waiting(b, 2, "job/ranked", 4, ranks=(0, 2))
    with pytest.raises(errors.BarrierTimeout, match=r"3 of 4 parties arrived within 0.2 s; missing: rank 3$") as info:
        b.wait("job/ranked", 4, timeout=0.2, rank=1)
    assert (info.value.arrived, info.value.parties, info.value.missing) == (3, 4, [3])   # as fields too
    b.close()
    for t in waiting:
        t.join(10)


def test_ranks_are_not_named_when_a_caller_gave_none() -> None:
    b = Barriers()
    waiting = _waiting(b, 1, "job/some", 3)
    with pytest.raises(errors.BarrierTimeout) as info:
        b.wait("job/some", 3, timeout=0.2, rank=0)
    assert str(info.value).endswith("2 of 3 parties arrived within 0.2 s")
    assert (info.value.arrived, info.value.parties, info.value.missing) == (2, 3, None)
    b.close()
    for t in waiting:
        t.join(10)


def test_a_rank_outside_the_parties_is_refused() -> None:
    b = Barriers()
    with pytest.raises(errors.InvalidArgument, match=r"rank 4 is not among 4 parties \(0 .. 3\)"):
        b.wait("job/r", 4, timeout=1, rank=4)
    assert b._waiting == 0 and "job/r" not in b._barriers  # noqa: SLF001
