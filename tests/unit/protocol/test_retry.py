"""Backoff and Retry on their own: delays, deadlines, stop events, what is retried."""
from __future__ import annotations

import random

import pytest

from smb_protocol.retry import Backoff, Retry


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_backoff_grows_to_its_cap_and_resets() -> None:
    b = Backoff(first=0.1, cap=0.5, factor=2.0)
    assert [round(b.next_delay(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.next_delay() == pytest.approx(0.1)


def test_backoff_jitter_stays_within_its_fraction() -> None:
    b = Backoff(first=1.0, cap=1.0, jitter=0.5, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(200)]
    assert all(0.5 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 100          # really drawn, not one value


@pytest.mark.parametrize("kwargs", [dict(first=0), dict(first=1, cap=0.5), dict(factor=0.5),
                                    dict(jitter=1.5)])
def test_backoff_refuses_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_retry_returns_after_transient_failures() -> None:
    clock = FakeClock()
    calls = []

    def flaky() -> str:
        calls.append(clock.now)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "ok"
    r = Retry(on=(ConnectionError,), timeout=5.0, backoff=Backoff(first=0.1, cap=1.0),
              clock=clock, sleep=clock.sleep)
    assert r(flaky) == "ok"
    assert clock.slept == pytest.approx([0.1, 0.2])


def test_retry_gives_up_at_the_deadline_with_the_last_error() -> None:
    clock = FakeClock()
    n = [0]

    def down() -> None:
        n[0] += 1
        raise ConnectionError(f"attempt {n[0]}")
    r = Retry(on=(ConnectionError,), timeout=1.0, backoff=Backoff(first=0.3, cap=0.3),
              clock=clock, sleep=clock.sleep)
    with pytest.raises(ConnectionError, match="attempt 4"):
        r(down)
    assert clock.now <= 1.0


@pytest.mark.parametrize("error, options", [
    (ValueError("no"), dict(sleep=lambda s: None)),                     # not an error it retries
    (ConnectionError("down"), dict(timeout=None, sleep=lambda s: True)),   # the sleep says stop
], ids=["other-errors", "sleep-says-stop"])
def test_retry_calls_once_and_raises(error: Exception, options: dict) -> None:
    n = [0]

    def fail() -> None:
        n[0] += 1
        raise error
    with pytest.raises(type(error)):
        Retry(on=(ConnectionError,), **options)(fail)
    assert n[0] == 1


def test_backoff_over_a_list_waits_only_after_a_whole_round() -> None:
    b = Backoff(first=0.1, cap=0.4, per_round=3)
    assert [round(b.next_delay(), 3) for _ in range(12)] == [0, 0, 0.1, 0, 0, 0.2, 0, 0, 0.4, 0, 0, 0.4]
    b.reset()                                # a success starts a new round from ``first``
    assert [b.next_delay() for _ in range(3)] == pytest.approx([0, 0, 0.1])
    with pytest.raises(ValueError):
        Backoff(per_round=0)


def test_retry_over_a_list_tries_every_server_before_it_sleeps() -> None:
    clock = FakeClock()
    servers = ["dead", "standby", "leader"]
    tried: list[tuple[str, float]] = []

    def call() -> str:
        server = servers[len(tried) % 3]
        tried.append((server, clock.now))
        if server != "leader" or clock.now < 0.25:   # the standby takes over at 0.25 s
            raise ConnectionError(server)
        return server
    r = Retry(on=(ConnectionError,), timeout=5.0, backoff=Backoff(first=0.1, cap=0.2, per_round=3),
              clock=clock, sleep=clock.sleep)
    assert r(call) == "leader"
    assert tried == [("dead", 0.0), ("standby", 0.0), ("leader", 0.0), ("dead", 0.1), ("standby", 0.1),
                     ("leader", 0.1), ("dead", pytest.approx(0.3)), ("standby", pytest.approx(0.3)),
                     ("leader", pytest.approx(0.3))]
