"""A blocking pool of connections to one peer, shared by the transports.

A :class:`ConnectionPool` makes up to ``size`` connections on demand with a factory and
hands them out one caller at a time. A caller that finds every connection busy waits on
a condition variable until one is released (no polling). Waiters are served in the
order they came: a caller that gives a connection back and asks again at once queues
behind them, so no thread starves while others keep the pool busy. A connection whose ``closed``
property is true when it comes back is dropped, and its slot is refilled by the next
caller that needs one. :meth:`ConnectionPool.close` closes the idle connections, closes
busy ones as they come back, and makes later acquires raise :class:`ServerUnavailable`.

The pool owns the connections it made: it closes them, callers never do (a caller that
finds a connection broken closes it and releases it; the pool then forgets it).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from smb_protocol.errors import InvalidArgument, ServerUnavailable, Timeout

log = logging.getLogger(__name__)


class Connection(Protocol):
    """What the pool needs of a connection."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


C = TypeVar("C", bound=Connection)


class ConnectionPool(Generic[C]):
    """Up to ``size`` connections made by ``factory()``, handed out one caller at a time.

    ``name`` (e.g. the peer's URI) appears in error messages. ``timeout`` (seconds, None:
    forever) bounds how long :meth:`acquire` waits for a busy connection to come back.
    """

    def __init__(self, factory: Callable[[], C], size: int, name: str = "",
                 timeout: float | None = None) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"pool size must be a positive number of connections, not {size!r}")
        self._factory = factory
        self.size = size
        self.name = name or "pool"
        self.timeout = timeout
        self._cond = threading.Condition()
        self._idle: list[C] = []
        self._busy: set[int] = set()   # id() of connections handed out
        self._opening = 0              # slots taken by factories still running
        self._queue: deque[int] = deque()   # turns of the callers waiting, oldest first
        self._turns = itertools.count()
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections made and not yet dropped (idle, busy, or being made)."""
        with self._cond:
            return len(self._idle) + len(self._busy) + self._opening

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire(self) -> C:
        """A connection for the caller alone until :meth:`release`; waits while all
        ``size`` are busy. Raises :class:`ServerUnavailable` once the pool is closed (or
        what the factory raised), :class:`Timeout` after ``timeout`` seconds of waiting."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            turn = next(self._turns)
            self._queue.append(turn)
            try:
                while True:
                    if self._closed:
                        raise ServerUnavailable(f"{self.name}: connection pool is closed")
                    if self._queue[0] == turn:   # no earlier caller still waiting
                        while self._idle:
                            conn = self._idle.pop()
                            if conn.closed:       # broke while idle (peer went away)
                                conn.close()      # still frees what it holds (sockets, verbs resources)
                                continue
                            self._busy.add(id(conn))
                            return conn
                        if len(self._busy) + self._opening < self.size:
                            self._opening += 1
                            break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise Timeout(f"{self.name}: all {self.size} connections stayed busy for "
                                      f"{self.timeout:g} s")
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(turn)
                self._cond.notify_all()   # the next turn looks again
        try:
            conn = self._factory()
        except BaseException:
            with self._cond:
                self._opening -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._opening -= 1
            if self._closed:
                self._cond.notify_all()
                closed_meanwhile = True
            else:
                self._busy.add(id(conn))
                closed_meanwhile = False
        if closed_meanwhile:
            conn.close()
            raise ServerUnavailable(f"{self.name}: connection pool is closed")
        return conn

    def release(self, conn: C) -> None:
        """Give back a connection from :meth:`acquire`; a closed one is dropped."""
        with self._cond:
            if id(conn) not in self._busy:
                raise InvalidArgument(f"{self.name}: released a connection this pool did not hand out")
            self._busy.discard(id(conn))
            drop = self._closed or conn.closed
            if not drop:
                self._idle.append(conn)
            self._cond.notify_all()   # the waiter whose turn it is may be any of them
        if drop:
            conn.close()

    @contextmanager
    def borrow(self) -> Iterator[C]:
        """``with pool.borrow() as conn:`` — acquire, and release however the block ends."""
        conn = self.acquire()
        try:
            yield conn
        finally:
            self.release(conn)

    def close(self) -> None:
        """Close the idle connections now and busy ones when released; later acquires
        raise :class:`ServerUnavailable`. Idempotent."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for conn in idle:
            try:
                conn.close()
            except Exception as exc:  # closing must not stop closing the others
                log.debug("%s: closing a connection: %s", self.name, exc)

    def __enter__(self) -> ConnectionPool[C]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
