"""How long a request is tried again, and how: the retry decision that a region's route
and a collective's exchanger share (:class:`Retrying`), the pauses before a request goes
again to an extent being moved (:func:`move_backoff`), and the deadlines of waits that
are sent in slices (:func:`until`, :func:`in_slices`)."""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from typing import TypeVar

from smb_protocol import errors
from smb_protocol.errors import InvalidArgument, TicketExpired, Timeout
from smb_protocol.retry import Backoff

from .transports.errors import ConnectionBroken

T = TypeVar("T")

FAILOVER_TIMEOUT = 30.0    # seconds an operation on a moved or replicated region waits for its extent
WAIT_SLICE = 30.0          # seconds one waiting request waits at most; longer waits send several
RESENDS = 3                # extra sends of one request whose connection broke or whose ticket expired


def move_backoff() -> Backoff:
    """The pauses before a request goes again to an extent being moved or failed over."""
    return Backoff(first=0.02, cap=0.5)


class Next(enum.Enum):
    """What to do with a request that failed (:meth:`Retrying.decide`)."""

    RESEND = "resend"     # send it again, as it is, on a new connection
    REFRESH = "refresh"   # renew the ticket (open the region again), then send it again
    PAUSE = "pause"       # its extent is moving: wait, open the region again, send it again
    FAIL = "fail"         # the failure is the request's outcome


class Retrying:
    """The retry decision for one numbered request (sent again with its number, so the
    server applies it at most once): a broken connection or an expired ticket is worth
    :data:`RESENDS` more sends; an extent being moved (NotPrimary) or released by a move
    (ExtentNotFound) is waited for with :func:`move_backoff` pauses for up to
    :data:`FAILOVER_TIMEOUT` seconds; anything else fails. The route's own operations
    (:meth:`Route.run`) use the same pauses and limits."""

    __slots__ = ("sends", "moved_at", "backoff")

    def __init__(self) -> None:
        self.sends = 0
        self.moved_at = 0.0
        self.backoff: Backoff | None = None

    def decide(self, err: BaseException) -> tuple[Next, float]:
        """What to do after ``err``, and the pause (seconds) before it."""
        if isinstance(err, errors.NotPrimary | errors.ExtentNotFound):
            now = time.monotonic()
            self.moved_at = self.moved_at or now
            if now - self.moved_at >= FAILOVER_TIMEOUT:
                return Next.FAIL, 0.0
            if self.backoff is None:
                self.backoff = move_backoff()
            return Next.PAUSE, self.backoff.next_delay()
        if isinstance(err, ConnectionBroken | TicketExpired) and self.sends < RESENDS:
            self.sends += 1
            return (Next.REFRESH if isinstance(err, TicketExpired) else Next.RESEND), 0.0
        return Next.FAIL, 0.0

    @property
    def moved(self) -> bool:
        """Whether a move refused the request (send it after opening the region again)."""
        return self.moved_at != 0.0



__all__ = ["FAILOVER_TIMEOUT", "WAIT_SLICE", "RESENDS", "Next", "Retrying", "move_backoff", "until", "in_slices"]


def until(timeout: float | None) -> float:
    """The monotonic deadline ``timeout`` seconds from now (None: infinity)."""
    if timeout is None:
        return math.inf
    if not (isinstance(timeout, (int, float)) and timeout >= 0 and not math.isnan(timeout)):
        raise InvalidArgument(f"timeout must be >= 0 seconds or None, not {timeout!r}")
    return time.monotonic() + timeout


def in_slices(deadline: float, fn: Callable[[float], T]) -> T:
    """Call ``fn(seconds)`` with slices of at most :data:`WAIT_SLICE` seconds until it
    returns or ``deadline`` (monotonic) passes; the last :class:`Timeout` propagates."""
    while True:
        left = max(0.0, min(deadline - time.monotonic(), WAIT_SLICE))
        try:
            return fn(left)
        except Timeout:
            if time.monotonic() >= deadline:
                raise
