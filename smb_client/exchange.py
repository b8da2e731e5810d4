"""The order a collective's chunks travel in: one sending thread, a window of bytes in
flight across all servers, the chunks the next forward pass needs first.

An :class:`Exchanger` belongs to one :class:`~smb_client.collective.Collective`. A round
hands it each chunk as the chunk's bytes become final (:meth:`Exchanger.submit`); its
thread sends the waiting chunk of highest priority as a ``REDUCE`` on the pipelined
stream of the chunk's server (:mod:`smb_client.transports.stream`) as soon as the bytes
in flight leave room: a chunk is in flight from its send until the server says its push
took effect. The sums come back on the same streams as they complete, straight into the
caller's buffer. So:

* every party sends its chunks in the same order (priority: the lowest chunk index,
  which holds the first layers' gradients, first; or the order they became ready), one
  window at a time, so chunks complete in that order and their sums stream back while
  later chunks are still going out;
* the window is counted against pushes taking effect, never against sums: those need
  the other parties' pushes, and a window that waited on them could wait forever for a
  party whose own window waits on this one;
* no thread per chunk and no round trip per chunk: one sender per collective, one
  receiving thread per server stream.

The chunks go on the streams the region's route hands out (:meth:`Route.stream
<smb_client.route.Route.stream>`), and a failed chunk follows the route's retry decision
(:class:`~smb_client.route.Retrying`): one whose connection broke, or whose ticket
expired, is sent again with the same sequence number, on a new connection or after
renewing the ticket (the server applies its push and counts its pull at most once and
answers the repeat with the sum); one whose extent is being moved to another server
(NotPrimary), or was released by the move (ExtentNotFound), is sent again with the same
number after a pause and opening the region again (the move carries the extent's
exactly-once entries to the new server); the pause is kept by the sending thread, not a
timer. Any other failure is the chunk's error; :meth:`Exchanger.abandon` then stops what
is still in flight.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Protocol

from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.errors import InvalidArgument, ServerUnavailable, SMBError
from smb_protocol.placement import ExtentPlace
from smb_protocol.rounds import ChunkRound

from .region import Region
from .retrying import Next, Retrying
from .route import name_server
from .transports.stream import Reducer, Reduction
from .wire_chunk import WireChunk

log = logging.getLogger(__name__)

class Chunk:
    """Where chunk ``index`` lives: its layout slot and server (``place``, as the region
    was described when the collective was made), the extent offsets of its two slots and
    of their count words, and its byte range in the caller's buffer."""

    def __init__(self, index: int, slot: int, place: ExtentPlace, extent_offset: int, region_offset: int,
                 start: int, length: int) -> None:
        self.index = index
        self.slot = slot
        self.place = place
        self.start = start
        self.length = length
        self.slots = (extent_offset, extent_offset + length)
        self.words = (extent_offset + 2 * length, extent_offset + 2 * length + 8)
        self.region_words = region_offset + 2 * length   # region offset of the two count words


ENV_TRANSPORT = "SMB_EXCHANGE_TRANSPORT"


def exchange_transport(transport: str | None) -> str:
    """What a collective's chunks travel on: ``auto`` (the default, or
    ``$SMB_EXCHANGE_TRANSPORT``) by RDMA where the region's data goes over rdma, else
    over the servers' tcp planes; ``tcp`` always over the tcp planes."""
    value = transport if transport is not None else os.environ.get(ENV_TRANSPORT) or "auto"
    if value not in ("auto", "tcp"):
        raise InvalidArgument(f"a collective's transport is 'auto' or 'tcp', not {value!r}"
                              + ("" if transport is not None else f" (from ${ENV_TRANSPORT})"))
    return value


class Owner(Protocol):
    """What an exchanger needs of its collective."""

    region: Region
    parties: int
    timeout: float
    transport: str



class _Task:
    __slots__ = ("chunk", "slot", "round", "parts", "types", "wire", "seq", "nbytes", "future", "in_flight",
                 "retrying", "ticket", "stream")

    def __init__(self, chunk: Chunk, round_: int, parts: Sequence[memoryview], types: ChunkTypes,
                 seq: int) -> None:
        self.chunk = chunk
        self.slot = round_ % 2
        self.round = round_
        self.parts = list(parts)
        self.types = types
        self.wire = WireChunk(self.parts, types) if types.wire else None   # narrowed once, for every send
        self.seq = seq
        self.nbytes = self.wire.nbytes if self.wire is not None else sum(len(p) for p in self.parts)
        self.future: Future[None] = Future()
        self.in_flight = False
        self.retrying = Retrying()
        self.ticket = ""
        self.stream: Reducer | None = None


class Exchanger:
    """Sends a collective's chunks through a window of ``window`` bytes; ``priority``:
    lowest chunk index first (else in the order they were submitted)."""

    def __init__(self, coll: Owner, window: int, priority: bool = True) -> None:
        self.coll = coll
        self.window = window
        self.priority = priority
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, _Task]] = []
        self._paused: list[tuple[float, int, _Task]] = []   # (monotonic time due, order, task)
        self._order = itertools.count()
        self._bytes = 0                      # bytes sent whose push has not taken effect
        self._sent: set[_Task] = set()       # sent, sum not in yet
        self._closed = False
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"smb-exchange {coll.region.name}",
                                        daemon=True)
        self._thread.start()

    # -- the round's side -------------------------------------------------------------
    def submit(self, chunk: Chunk, round_: int, parts: Sequence[memoryview], types: ChunkTypes) -> Future[None]:
        """Queue ``chunk``'s share of round ``round_`` (``parts`` of ``types.slot``,
        travelling as ``types`` say); the future ends once its sum is in ``parts``."""
        task = _Task(chunk, round_, parts, types, self.coll.region.route.next_seq())
        self._queue_task(task)
        return task.future

    def _queue_task(self, task: _Task, pause: float = 0.0) -> None:
        with self._cond:
            if self._closed or self._abandoned:
                _settle(task.future, ServerUnavailable(
                    f"collective {self.coll.region.name} is closed" if self._closed else
                    f"collective {self.coll.region.name}: the round failed elsewhere"))
                return
            if pause > 0:
                heapq.heappush(self._paused, (time.monotonic() + pause, next(self._order), task))
            else:
                self._ready(task)
            self._cond.notify_all()

    def _ready(self, task: _Task) -> None:
        """Put ``task`` among the chunks ready to go (under the condition): the lowest
        chunk first with ``priority``, else in order."""
        key = task.chunk.index if self.priority else 0
        heapq.heappush(self._queue, (key, next(self._order), task))

    def abandon(self) -> None:
        """Fail what is queued, and close the streams of what is in flight (their
        futures then fail too), so that nothing writes into the caller's buffer after
        the round gave up; send nothing more (the collective cannot go on)."""
        with self._cond:
            self._abandoned = True
            queued, self._queue = self._queue, []
            queued += [(0, order, task) for _, order, task in self._paused]
            self._paused = []
            streams = {id(t.stream): t.stream for t in self._sent if t.stream is not None}
        for _, _, task in queued:
            _settle(task.future, ServerUnavailable("the round failed elsewhere"))
        for stream in streams.values():
            if stream is not None:
                stream.abandon()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.abandon()
        self._thread.join()

    # -- the sending thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    due_in = self._unpause()
                    if self._closed or (self._queue and (
                            self._bytes == 0 or self._bytes + self._queue[0][2].nbytes <= self.window)):
                        break
                    self._cond.wait(due_in)
                if self._closed:
                    return
                _, _, task = heapq.heappop(self._queue)
                if self._abandoned:
                    _settle(task.future, ServerUnavailable("the round failed elsewhere"))
                    continue
                self._bytes += task.nbytes
                task.in_flight = True
                self._sent.add(task)
            try:
                self._send(task)
            except SMBError as exc:   # no session (the server is gone), no ticket
                self._done(task, exc)
            except BaseException as exc:   # nothing must end this thread with work queued
                log.exception("collective %s: sending chunk %d failed", self.coll.region.name,
                              task.chunk.index)
                self._done(task, ServerUnavailable(f"{type(exc).__name__}: {exc}"))
            with self._cond:
                late = self._abandoned and task.stream is not None and task in self._sent
            if late:   # abandoned while this one went out: it must not wait for a sum
                assert task.stream is not None
                task.stream.abandon()

    def _unpause(self) -> float | None:
        """Queue the paused chunks that are due (under the condition); seconds until the
        next one is (None: none paused)."""
        now = time.monotonic()
        while self._paused and self._paused[0][0] <= now:
            self._ready(heapq.heappop(self._paused)[2])
        return self._paused[0][0] - now if self._paused else None

    def _send(self, task: _Task) -> None:
        route = self.coll.region.route
        if task.retrying.moved or (task.retrying.sends and task.ticket == route.ticket):
            route.refresh()   # a fresh ticket and where the extent is now (RegionNotFound once it is gone)
        stream, place = route.stream(task.chunk.slot, self.coll.transport == "auto")
        if stream is None:
            raise ServerUnavailable(f"server {place.server_id} has no pipelined stream")
        task.stream = stream
        task.ticket = route.ticket
        c, w = task.chunk, task.wire
        stream.send(task.ticket, Reduction(
            place.extent_id, c.slots[task.slot], task.parts if w is None else w.sent, task.types,
            ChunkRound(c.words[task.slot], self.coll.parties, task.round), self.coll.timeout, task.seq,
            pushed=lambda: self._pushed(task), done=lambda err: self._done(task, err),
            into=None if w is None else w.into, received=None if w is None else w.received))

    def _pushed(self, task: _Task) -> None:
        with self._cond:
            if task.in_flight:
                task.in_flight = False
                self._bytes -= task.nbytes
                self._cond.notify_all()

    def _done(self, task: _Task, err: BaseException | None) -> None:
        self._pushed(task)
        with self._cond:
            self._sent.discard(task)
        if err is not None and not task.future.done():
            step, pause = task.retrying.decide(err)
            if step is not Next.FAIL:
                log.info("collective %s: chunk %d again (%s, %.2f s): %s", self.coll.region.name,
                         task.chunk.index, step.value, pause, err)
                self._queue_task(task, pause)
                return
        if isinstance(err, ServerUnavailable):
            name_server(err, self.coll.region.route.extents[task.chunk.slot].server_id)
        _settle(task.future, err)


def _settle(future: Future[None], err: BaseException | None) -> None:
    """End ``future`` unless it already ended (a chunk abandoned while its answer came)."""
    try:
        if err is None:
            future.set_result(None)
        else:
            future.set_exception(err)
    except InvalidStateError:
        pass
