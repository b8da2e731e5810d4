"""The daemon base: lifecycle, failed starts, context manager, signals, atomic writes."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from smb_protocol import errors
from smb_server.runtime import daemon
from smb_server.runtime.daemon import Daemon, Status, write_atomic


class Recorder(Daemon):
    kind = "recorder"

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.events: list[str] = []

    def _start(self) -> None:
        self.events.append(f"start:{self.status}")
        if self.fail is not None:
            raise self.fail

    def _close(self, was: Status) -> None:
        self.events.append(f"close:{was}:{self.status}")


def test_lifecycle() -> None:
    d = Recorder()
    assert d.status is Status.STARTING and d.status == "starting"
    assert d.start() is d
    assert d.status is Status.RUNNING
    d.stop("done")
    d.stop("again")                      # idempotent
    assert d.status is Status.CLOSED
    assert d.events == ["start:starting", "close:running:closing"]
    assert d.stop_reason == "done"
    with pytest.raises(errors.InvalidArgument, match="cannot start a recorder that is closed"):
        d.start()


def test_cannot_start_twice() -> None:
    d = Recorder().start()
    with pytest.raises(errors.InvalidArgument, match="running"):
        d.start()
    d.stop()


def test_failed_start_closes_and_raises() -> None:
    d = Recorder(fail=OSError("port busy"))
    with pytest.raises(OSError, match="port busy"):
        d.start()
    assert d.status is Status.CLOSED
    assert d.events == ["start:starting", "close:starting:closing"]
    d.stop()                             # nothing more to close
    assert len(d.events) == 2


def test_stop_before_start_closes_once() -> None:
    d = Recorder()
    d.stop()
    assert d.events == ["close:starting:closing"]
    with pytest.raises(errors.InvalidArgument):
        d.start()


def test_context_manager() -> None:
    with Recorder() as d:
        assert d.status is Status.RUNNING
    assert d.status is Status.CLOSED
    started = Recorder().start()
    with started as same:                # already started: not started again
        assert same is started
    assert started.events == ["start:starting", "close:running:closing"]


def test_run_forever_stops_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "RUN_POLL", 0.01)
    before = signal.getsignal(signal.SIGTERM)
    d = Recorder()
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    d.run_forever()
    timer.join()
    assert d.status is Status.CLOSED
    assert d.stop_reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before     # handler restored


def test_run_forever_ends_when_the_daemon_stops_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "RUN_POLL", 0.01)

    class StopsItself(Recorder):
        def tick(self) -> None:
            self.stop("lost the controller")

    d = StopsItself()
    d.run_forever()
    assert d.stop_reason == "lost the controller"
    assert d.status is Status.CLOSED


def test_write_atomic(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ready.json"
    write_atomic(str(path), "one")
    write_atomic(str(path), "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["ready.json"]   # no temporary left


def test_write_atomic_leaves_no_temporary_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "dir-in-the-way"
    target.mkdir()
    (target / "x").write_text("")        # os.replace onto a non-empty directory fails
    with pytest.raises(OSError):
        write_atomic(str(target), "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir-in-the-way"]
