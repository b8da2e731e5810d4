"""A memory server's link to the controller: which call comes next and when.

:class:`ControllerLink` is the pure sequencing of the register/heartbeat loop: register
until the controller accepts, then heartbeat every interval; on errors wait the next
:class:`smb_protocol.retry.Backoff` delay (the controller may be restarting); when the
controller has forgotten this server (``NotFound`` on a heartbeat), register again at
once. The calls themselves are passed in, so the sequencing is tested without gRPC.
:meth:`ControllerLink.run` steps until stopped; :meth:`ControllerLink.wake` makes the
next call at once (a heartbeat with news: a backup this server's primary marked failed,
which the controller must drop before the mutations waiting on it can be answered).

:class:`Controllers` holds the controllers a server may talk to (``--controller`` takes
a comma-separated list: a leader and its standbys); when the one it talks to is
unavailable (a standby refuses, or it does not answer), the link moves on to the next.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from smb_protocol import errors
from smb_protocol.retry import Backoff

log = logging.getLogger(__name__)

LOUD_FAILURES = (1, 10)  # failures logged as warnings (and every 100th); others at debug


class ControllerLink:
    """``register`` and ``heartbeat`` make one call each and raise typed errors;
    ``interval`` gives the seconds between heartbeats; ``backoff`` paces retries.
    ``where`` names the controller in log messages."""

    def __init__(self, register: Callable[[], None], heartbeat: Callable[[], None],
                 interval: Callable[[], float], backoff: Backoff, where: str = "",
                 controllers: Controllers | None = None) -> None:
        self.controllers = controllers
        self.register = register
        self.heartbeat = heartbeat
        self.interval = interval
        self.backoff = backoff
        self.where = where
        self.need_register = True
        self.failures = 0  # failed calls in a row
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Make the next call now instead of after the interval (thread-safe). While
        the controller is failing, the backoff stands."""
        self._wake.set()

    def start(self) -> None:
        """Run :meth:`run` on a daemon thread of its own (``heartbeat``)."""
        self._thread = threading.Thread(target=self.run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End :meth:`run` and wait up to ``timeout`` seconds for the thread of
        :meth:`start` (thread-safe)."""
        self._stopped.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def run(self) -> None:
        """Step until :meth:`stop`: wait the delay each step returns, cut short by
        :meth:`wake` unless the last call failed."""
        while not self._stopped.is_set():
            self._wake.clear()
            delay = self.step()
            (self._stopped if self.failures else self._wake).wait(delay)

    def step(self) -> float:
        """Make the next call; returns the seconds to wait before the next step."""
        try:
            if self.need_register:
                self.register()
                self.need_register = False
            else:
                self.heartbeat()
        except errors.NotFound as exc:
            if self.need_register:  # the registration itself was refused: do not spin
                self.failures += 1
                log.warning("controller %s refused the registration: %s", self.where, exc)
                return self.backoff.next_delay()
            log.warning("controller %s does not know this server (%s); registering again",
                        self.where, exc)
            self.need_register = True
            return 0.0
        except errors.PermissionDenied as exc:  # wrong secret, or wrong credential
            self.failures += 1
            if self.failures in LOUD_FAILURES or self.failures % 100 == 0:
                log.warning("controller %s refused this server's credential: %s: %s (attempt %d; "
                            "is secret_file the controller's secret?)", self.where,
                            type(exc).__name__, exc, self.failures)
            return self.backoff.next_delay()
        except (errors.ControllerUnavailable, errors.Timeout) as exc:  # a standby, down, or paused
            if self.controllers is not None and len(self.controllers) > 1:
                self.failures += 1
                was = self.controllers.address
                self.controllers.rotate()
                log.log(logging.INFO if self.failures in LOUD_FAILURES else logging.DEBUG,
                        "controller %s: %s; trying %s", was, exc, self.controllers.address)
                # a whole round of the list without a leader: wait before the next round
                return self.backoff.next_delay() if self.failures % len(self.controllers) == 0 else 0.0
            return self._failed(exc)
        except errors.SMBError as exc:
            return self._failed(exc)
        except Exception:
            self.failures += 1
            log.exception("call to the controller %s failed", self.where)
            return self.backoff.next_delay()
        if self.failures:
            log.info("controller %s reachable again", self.where)
        self.failures = 0
        self.backoff.reset()
        return self.interval()

    def _failed(self, exc: errors.SMBError) -> float:
        self.failures += 1
        loud = self.failures in LOUD_FAILURES or self.failures % 100 == 0
        log.log(logging.WARNING if loud else logging.DEBUG,
                "controller %s: %s: %s (attempt %d; still serving data)", self.where,
                type(exc).__name__, exc, self.failures)
        return self.backoff.next_delay()


class Controllers:
    """The controllers of a comma-separated ``addresses`` list and the one in use.

    ``channel(address)`` opens a gRPC channel (when an address is first used; kept
    until :meth:`close`), ``stub(channel)`` wraps it. Owns those channels.
    """

    def __init__(self, addresses: str, channel: Callable[[str], Any],
                 stub: Callable[[Any], Any]) -> None:
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not self.addresses:
            raise errors.InvalidArgument(f"no controller address in {addresses!r} (host:port,...)")
        self._channel = channel
        self._stub = stub
        self._open: dict[str, tuple[Any, Any]] = {}  # address -> (channel, stub)
        self.index = 0

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def address(self) -> str:
        return self.addresses[self.index]

    @property
    def stub(self) -> Any:
        """The stub of the controller in use."""
        opened = self._open.get(self.address)
        if opened is None:
            channel = self._channel(self.address)
            opened = self._open[self.address] = (channel, self._stub(channel))
        return opened[1]

    def rotate(self) -> None:
        """Use the next controller of the list."""
        self.index = (self.index + 1) % len(self.addresses)

    def close(self) -> None:
        for channel, _ in self._open.values():
            channel.close()
        self._open.clear()
