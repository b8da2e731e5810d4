"""One lifecycle for every long-running part: controller, memory server, local cluster.

A :class:`Daemon` is ``starting`` when constructed, ``running`` after :meth:`start`,
``closing`` inside :meth:`stop` and ``closed`` after it; it cannot be started twice.
Subclasses write :meth:`Daemon._start` (bring everything up; on an exception the
base closes what was opened by calling :meth:`Daemon._close`) and
:meth:`Daemon._close` (close what is open; must cope with a partial start).

``with daemon:`` starts it (unless started) and stops it on exit; :meth:`run_forever`
starts it, tells systemd ``READY=1``, serves until SIGTERM or SIGINT, then stops.
"""
from __future__ import annotations

import enum
import faulthandler
import logging
import os
import signal
import tempfile
import threading
from types import FrameType
from typing import TypeVar

from smb_protocol import errors
from smb_server.runtime import sdnotify

log = logging.getLogger(__name__)

RUN_POLL = 0.5  # seconds between looks at the daemon's health in run_forever
SIGNALS = (signal.SIGTERM, signal.SIGINT)

D = TypeVar("D", bound="Daemon")


class Status(enum.StrEnum):
    """Lifecycle of a daemon; compares equal to its string value."""

    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Daemon:
    """Base of the controller, the memory server and the local cluster."""

    #: what the logs call this kind of daemon
    kind = "daemon"

    def __init__(self) -> None:
        self.status = Status.STARTING
        self._started = False
        self._lifecycle = threading.RLock()
        self.stop_reason = ""  # the signal that stopped run_forever, or what stop() was told

    # -- for subclasses --------------------------------------------------------------------
    def _start(self) -> None:
        """Bring the daemon up (called once, with the lifecycle lock held)."""
        raise NotImplementedError

    def _close(self, was: Status) -> None:
        """Close what is open; ``was`` is the status before closing (``starting`` after a
        failed start)."""
        raise NotImplementedError

    def ready_message(self) -> str:
        """The systemd ``STATUS=`` line sent with ``READY=1``."""
        return f"{self.kind} running"

    def tick(self) -> None:
        """Called every RUN_POLL seconds by :meth:`run_forever` while running."""

    # -- lifecycle -------------------------------------------------------------------------
    def start(self: D) -> D:
        """Start; raises InvalidArgument when not ``starting`` or already started.

        On failure everything opened is closed, the status is ``closed`` and the error
        propagates."""
        with self._lifecycle:
            if self.status is not Status.STARTING or self._started:
                raise errors.InvalidArgument(f"cannot start a {self.kind} that is {self.status}"
                                             f"{' (already started)' if self._started else ''}; "
                                             "make a new one")
            self._started = True
            try:
                self._start()
            except BaseException:
                self.status = Status.CLOSING
                try:
                    self._close(Status.STARTING)
                except Exception:
                    log.exception("closing a %s that failed to start", self.kind)
                self.status = Status.CLOSED
                raise
            self.status = Status.RUNNING
        return self

    def stop(self, reason: str = "stopped") -> None:
        """Close everything (idempotent); ``reason`` is kept in :attr:`stop_reason`."""
        with self._lifecycle:
            if self.status in (Status.CLOSING, Status.CLOSED):
                return
            was = self.status
            self.stop_reason = self.stop_reason or reason
            self.status = Status.CLOSING
            sdnotify.notify("STOPPING=1")
            try:
                self._close(was)
            finally:
                self.status = Status.CLOSED
        log.info("%s stopped (%s)", self.kind, self.stop_reason)

    def run_forever(self) -> None:
        """Start (unless started), serve until SIGTERM or SIGINT or until the daemon stops
        by itself, then stop. Signal handlers are installed only in the main thread and
        restored on return."""
        done = threading.Event()
        reason: list[str] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            reason.append(signal.Signals(signum).name)
            log.info("received %s; shutting down", reason[-1])
            done.set()

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS}
            # `kill -USR1 PID` writes every thread's stack to stderr (the daemon's log under
            # systemd and `smb up`): what an operator needs to see where a daemon hangs
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            # and a crash in native code (SIGSEGV, SIGBUS, SIGABRT...) writes them before
            # the process dies, instead of a log that just stops
            faulthandler.enable(all_threads=True)
        try:
            if self.status is Status.STARTING and not self._started:
                self.start()
            sdnotify.notify(f"READY=1\nSTATUS={self.ready_message()}")
            while not done.wait(RUN_POLL):
                if self.status is not Status.RUNNING:
                    break
                self.tick()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if previous:
                faulthandler.unregister(signal.SIGUSR1)
                faulthandler.disable()
            self.stop(reason[0] if reason else "stopped")

    def __enter__(self: D) -> D:
        """Start unless already started; stop on exit."""
        if self.status is Status.STARTING and not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one
    (temporary file in the same directory, then rename); creates the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
