"""A connection's own thread for the answers it owes but cannot send from where they
come up (``REDUCE`` sums, see :mod:`smb_protocol.wire`; on the rdma plane also a queue
pair's pushes).

A ``REDUCE`` is served in two halves. The connection's own thread receives the chunk,
applies the push (exactly once) and answers that it did; the sum goes back once every
party's push is in. On the tcp plane the push that completes the round sends it
(:mod:`.tcp_sums`, ``native/serve.c``); what it cannot send at once (the socket is full,
or the native loop handed the sum back) is queued here, and one thread per connection
serves the queue in order: it waits until the chunk's count shows every party's push,
sends the sum under the request's ``req_id`` and counts the pull
(:func:`.collective_ops.pull`, exactly once under ``seq + 1``), or answers the error it
was queued with (:meth:`Deliveries.refuse`). The reading thread is never held by a
chunk whose sum is not complete, so a client keeps a window of pushes in flight on one
connection while the sums stream back as they complete.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from smb_protocol.errors import SMBError

log = logging.getLogger(__name__)

T = TypeVar("T")

STOP_WAIT = 5.0   # seconds :meth:`Deliveries.stop` waits for the thread (it notices within RECHECK)


class _Refusal(Generic[T]):
    """A queued pull to answer with an error instead (:meth:`Deliveries.refuse`)."""

    __slots__ = ("pull", "err")

    def __init__(self, pull: T, err: SMBError) -> None:
        self.pull = pull
        self.err = err


class Deliveries(Generic[T]):
    """A FIFO of requests (pulls; on the rdma plane also a queue pair's pushes) served
    in order by a thread of its own.

    ``serve(pull)`` sends a pull's answer (blocking while its count is short);
    ``fail(pull, err)`` answers a typed error instead; ``broken(exc)`` is called once if
    serving raised anything else (the connection cannot go on: its owner closes it)."""

    def __init__(self, serve: Callable[[T], None], fail: Callable[[T, SMBError], None],
                 broken: Callable[[BaseException], None], name: str) -> None:
        self._serve = serve
        self._fail = fail
        self._broken = broken
        self._queue: deque[T | _Refusal[T]] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"smb-deliver {name}", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def put(self, pull: T) -> None:
        with self._cond:
            self._queue.append(pull)
            self._cond.notify()

    def refuse(self, pull: T, err: SMBError) -> None:
        """Answer ``pull`` with ``err``, in turn (from this queue's thread)."""
        with self._cond:
            self._queue.append(_Refusal(pull, err))
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, join: bool = True) -> None:
        """Drop what is queued (the client sends those requests again on a new
        connection) and end the thread (waiting for it with ``join``); a pull being
        served notices through its ``cancelled`` check."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify()
        if join and threading.current_thread() is not self._thread:
            self._thread.join(STOP_WAIT)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                item = self._queue.popleft()
            pull = item.pull if isinstance(item, _Refusal) else item
            try:
                if isinstance(item, _Refusal):
                    raise item.err
                self._serve(pull)
            except SMBError as exc:
                if self._stopped:
                    return
                try:
                    self._fail(pull, exc)
                except BaseException as why:   # the answer could not go out either
                    self._broken(why)
                    return
            except BaseException as exc:
                self._broken(exc)
                return
