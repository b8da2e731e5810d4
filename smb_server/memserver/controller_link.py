"""A memory server's link to the controller: which call comes next and when.

:class:`ControllerLink` is the pure sequencing of the register/heartbeat loop: register
until the controller accepts, then heartbeat every interval; on errors wait the next
:class:`smb_client.retry.Backoff` delay (the controller may be restarting); when the
controller has forgotten this server (``NotFound`` on a heartbeat), register again at
once. The calls themselves are passed in, so the sequencing is tested without gRPC.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from smb_client import errors
from smb_client.retry import Backoff

log = logging.getLogger(__name__)

LOUD_FAILURES = (1, 10)  # failures logged as warnings (and every 100th); others at debug


class ControllerLink:
    """``register`` and ``heartbeat`` make one call each and raise typed errors;
    ``interval`` gives the seconds between heartbeats; ``backoff`` paces retries.
    ``where`` names the controller in log messages."""

    def __init__(self, register: Callable[[], None], heartbeat: Callable[[], None],
                 interval: Callable[[], float], backoff: Backoff, where: str = "") -> None:
        self.register = register
        self.heartbeat = heartbeat
        self.interval = interval
        self.backoff = backoff
        self.where = where
        self.need_register = True
        self.failures = 0  # failed calls in a row

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
        except errors.SMBError as exc:
            self.failures += 1
            loud = self.failures in LOUD_FAILURES or self.failures % 100 == 0
            log.log(logging.WARNING if loud else logging.DEBUG,
                    "controller %s: %s: %s (attempt %d; still serving data)", self.where,
                    type(exc).__name__, exc, self.failures)
            return self.backoff.next_delay()
        except Exception:
            self.failures += 1
            log.exception("call to the controller %s failed", self.where)
            return self.backoff.next_delay()
        if self.failures:
            log.info("controller %s reachable again", self.where)
        self.failures = 0
        self.backoff.reset()
        return self.interval()
