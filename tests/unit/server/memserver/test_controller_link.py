"""The memory server's register/heartbeat sequencing, with scripted calls."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from smb_protocol import errors
from smb_protocol.retry import Backoff
from smb_server.memserver.controller_link import ControllerLink, Controllers

INTERVAL = 0.5


class Script:
    """Calls that answer from a list of outcomes (None: success) and record themselves."""

    def __init__(self, outcomes: list[BaseException | None]) -> None:
        self.outcomes = outcomes
        self.calls: list[str] = []

    def call(self, name: str) -> Callable[[], None]:
        def run() -> None:
            self.calls.append(name)
            outcome = self.outcomes.pop(0)
            if outcome is not None:
                raise outcome
        return run


def link_for(script: Script) -> ControllerLink:
    return ControllerLink(script.call("register"), script.call("heartbeat"), lambda: INTERVAL,
                          Backoff(first=0.1, cap=0.4, factor=2.0))


def test_registers_with_backoff_then_heartbeats() -> None:
    down = errors.ControllerUnavailable("connection refused")
    script = Script([down, down, down, down, None, None, None])
    link = link_for(script)
    waits = [link.step() for _ in range(7)]
    assert waits == [0.1, 0.2, 0.4, 0.4, INTERVAL, INTERVAL, INTERVAL]   # capped, then reset
    assert script.calls == ["register"] * 5 + ["heartbeat"] * 2


def test_backoff_starts_over_after_a_success() -> None:
    down = errors.ControllerUnavailable("restarting")
    script = Script([None, down, down, None, down])
    link = link_for(script)
    assert [link.step() for _ in range(5)] == [INTERVAL, 0.1, 0.2, INTERVAL, 0.1]
    assert script.calls == ["register"] + ["heartbeat"] * 4   # unreachable is not forgotten


def test_forgotten_server_registers_again_at_once() -> None:
    script = Script([None, errors.ServerNotFound("unknown server"), None, None])
    link = link_for(script)
    assert [link.step() for _ in range(4)] == [INTERVAL, 0.0, INTERVAL, INTERVAL]
    assert script.calls == ["register", "heartbeat", "register", "heartbeat"]


def test_refused_registration_backs_off_instead_of_spinning() -> None:
    refused = errors.NotFound("no such server")
    script = Script([refused, refused, None])
    link = link_for(script)
    assert [link.step() for _ in range(3)] == [0.1, 0.2, INTERVAL]
    assert script.calls == ["register"] * 3


def test_a_bug_in_a_call_backs_off_and_the_loop_goes_on() -> None:
    script = Script([RuntimeError("bug"), None])
    link = link_for(script)
    assert [link.step() for _ in range(2)] == [0.1, INTERVAL]
    assert link.failures == 0


def test_a_refused_credential_is_retried_with_backoff_and_named(caplog) -> None:
    refused = errors.AuthenticationError("RegisterServer: missing or wrong credential")
    script = Script([refused, refused, None, None])
    link = link_for(script)
    waits = [link.step() for _ in range(4)]
    assert waits == [0.1, 0.2, INTERVAL, INTERVAL]
    assert script.calls == ["register"] * 3 + ["heartbeat"]
    assert "refused this server's credential" in caplog.text and "secret_file" in caplog.text


class Stubs:
    """Channels and stubs that only say which address they are for."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []

    def channel(self, address: str) -> Stubs.Channel:
        self.opened.append(address)
        return Stubs.Channel(self, address)

    class Channel:
        def __init__(self, owner: Stubs, address: str) -> None:
            self.owner, self.address = owner, address

        def close(self) -> None:
            self.owner.closed.append(self.address)


def test_unavailable_controller_moves_on_to_the_next_of_the_list() -> None:
    stubs = Stubs()
    controllers = Controllers("a:1, b:2,c:3", stubs.channel, lambda ch: f"stub {ch.address}")
    standby = errors.ControllerUnavailable("this controller stands by; the leader is at c:3")
    used: list[str] = []

    def register() -> None:
        used.append(controllers.stub)
        if controllers.address != "c:3":
            raise standby

    link = ControllerLink(register, lambda: None, lambda: INTERVAL, Backoff(first=0.1, cap=0.4),
                          controllers=controllers)
    assert [link.step(), link.step(), link.step()] == [0.0, 0.0, INTERVAL]  # at once to the next
    assert used == ["stub a:1", "stub b:2", "stub c:3"] and not link.need_register
    # no controller leads: after a whole round of the list, back off
    link.need_register = True
    controllers.index = 0
    used.clear()
    assert [link.step(), link.step()] == [0.0, 0.0]
    controllers.addresses = ["a:1", "b:2", "d:4"]
    assert link.step() == 0.1
    controllers.close()
    assert sorted(stubs.closed) == sorted(set(stubs.opened)) == ["a:1", "b:2", "c:3", "d:4"]


def test_a_controller_that_does_not_answer_in_time_is_left_for_the_next() -> None:
    controllers = Controllers("a:1,b:2", lambda address: None, lambda ch: "stub")
    paused = errors.Timeout("Deadline Exceeded")
    link = ControllerLink(Script([paused, None]).call("register"), lambda: None, lambda: INTERVAL,
                          Backoff(first=0.1, cap=0.4), controllers=controllers)
    assert link.step() == 0.0 and controllers.address == "b:2"
    assert link.step() == INTERVAL and not link.need_register


def test_a_single_controller_backs_off_as_before() -> None:
    controllers = Controllers("a:1", lambda address: None, lambda ch: "stub")
    link = ControllerLink(Script([errors.ControllerUnavailable("down")] * 2).call("register"),
                          lambda: None, lambda: INTERVAL, Backoff(first=0.1, cap=0.4, factor=2.0),
                          controllers=controllers)
    assert [link.step(), link.step()] == [0.1, 0.2]


def test_an_empty_controller_list_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="no controller address"):
        Controllers(" , ", lambda address: None, lambda ch: None)


def test_wake_sends_the_next_heartbeat_at_once_and_stop_ends_the_loop() -> None:
    import threading
    import time
    beats = threading.Semaphore(0)
    link = ControllerLink(lambda: None, beats.release, lambda: 30.0, Backoff(first=0.1, cap=0.4))
    link.start()
    try:
        time.sleep(0.2)                      # registered, now waiting out the 30 s interval
        assert not beats.acquire(timeout=0.2)
        started = time.monotonic()
        link.wake()                          # a backup was marked failed: report it now
        assert beats.acquire(timeout=5.0)
        assert time.monotonic() - started < 2.0
    finally:
        started = time.monotonic()
        link.stop(5.0)
    assert time.monotonic() - started < 2.0  # stop cuts the interval short
    assert link._thread is not None and not link._thread.is_alive()
