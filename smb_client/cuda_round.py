"""All-reduce and broadcast of CUDA tensors, staged through pinned host memory.

:meth:`Collective.begin <smb_client.collective.Collective.begin>` and
:meth:`~smb_client.collective.Collective.broadcast` hand a CUDA tensor here. The round
itself runs on a pinned host copy (see :mod:`.cuda` for the staging and the streams);
this module orders the copies around it. Collectives are typed ``Any``: this module sits
below :mod:`.collective`, which calls it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from smb_protocol.errors import InvalidArgument

from .cuda import Stager, _flat_bytes, _host_view, _nbytes, stager_for

log = logging.getLogger(__name__)

__all__ = ["StagedRound", "begin", "broadcast"]

B = TypeVar("B")


class StagedRound:
    """One all-reduce round of a CUDA tensor (what :meth:`Collective.begin
    <smb_client.collective.Collective.begin>` returns for one), with the same
    :meth:`ready` and :meth:`finish`.

    The round runs on a pinned host copy of the tensor (an :class:`AllReduce
    <smb_client.collective_round.AllReduce>` of it). :meth:`ready` queues the device-to-host
    copy of the bytes it names on the caller's current stream's heels; a chunk whose
    bytes are all copied is handed to the round by one feeder thread as soon as its copy
    ended, so the copy of one chunk overlaps the exchange of those before it.
    :meth:`finish` sends what is left (the held chunk last), then copies each chunk's sum
    back to the device as soon as it arrived, in the order the chunks went out.
    """

    def __init__(self, stager: Stager, coll: Any, data: Any, dtype: Any,
                 runs: Sequence[tuple[int, int]] | None, hold: int | None,
                 wire: Any = None, full_sum: bool = False) -> None:
        self.stager = stager
        self.lane = stager.lane
        self.data = data
        self.raw = _flat_bytes(data)
        self.mirror = stager.mirror(self.raw.numel())
        self.streams = [self.lane.caller()]
        try:
            #: the round of the host copy (an AllReduce)
            self.inner: Any = coll.begin(_host_view(self.mirror, data.dtype), dtype, runs=runs, wire=wire,
                                         full_sum=full_sum)
        except BaseException:
            stager.unmirror(self.mirror)
            raise
        self.coll = coll
        packed = sum(n for _, n, _ in self.inner.runs)
        self._chunks = {c.index: (c.start, min(c.length, packed - c.start)) for c in coll.chunks
                        if c.start < packed}
        self._missing = {i: n for i, (_, n) in self._chunks.items()}
        self._held: int | None = None
        if hold is not None:
            at = self._packed(hold)
            self._held = next((i for i, (s, n) in self._chunks.items() if at is not None and s <= at < s + n),
                              None)
        self.launched: list[tuple[int, list[Future[None]]]] = []   # in the order they went out
        self._handed: set[int] = set()
        self._feeds: list[Future[None]] = []
        self._finished = False

    def _packed(self, offset: int) -> int | None:
        for off, n, packed in self.inner.runs:
            if off <= offset < off + n:
                return int(packed + offset - off)
        return None

    def _pieces(self, index: int) -> list[tuple[int, int]]:
        """Buffer byte ranges ``(offset, length)`` of chunk ``index``, in order."""
        start, n = self._chunks[index]
        out = []
        for off, length, packed in self.inner.runs:
            a, b = max(start, packed), min(start + n, packed + length)
            if a < b:
                out.append((off + a - packed, b - a))
        return out

    def _copy_out(self, ranges: Iterable[tuple[int, int]]) -> Any:
        event = None
        for off, n in ranges:
            for a, b in self.stager.spans(n):
                event = self.lane.copy(self.mirror[off + a:off + b], self.raw[off + a:off + b])
        return event

    def _hand(self, event: Any, chunks: list[int]) -> None:
        """On the feeder: once ``event`` happened, give ``chunks`` to the round."""
        self.lane.host_wait(event)
        for index in chunks:
            before = len(self.inner.futures)
            for off, n in self._pieces(index):
                self.inner.ready(off, n)
            self.launched.append((index, self.inner.futures[before:]))

    def _after_caller(self) -> None:
        stream = self.lane.caller()
        if stream not in self.streams:
            self.streams.append(stream)
        self.lane.after(stream)

    def ready(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset+length)`` are final on the caller's current stream
        (each byte once)."""
        self._after_caller()
        done: list[int] = []
        ranges = []
        for off, n, packed in self.inner.runs:
            a, b = max(offset, off), min(offset + length, off + n)
            if a >= b:
                continue
            ranges.append((a, b - a))
            lo, hi = packed + a - off, packed + b - off
            for index, (start, cn) in self._chunks.items():
                got = min(hi, start + cn) - max(lo, start)
                if got > 0 and index not in self._handed:
                    self._missing[index] -= got
                    if self._missing[index] <= 0 and index != self._held:
                        done.append(index)
        if not ranges:
            return
        event = self._copy_out(ranges)
        if done:
            self._handed.update(done)
            self._feeds.append(self.stager.feeder().submit(self._hand, event, sorted(done)))

    def finish(self) -> None:
        """Send the chunks not sent yet (copied now, from the caller's current stream),
        copy every sum back as it arrives, wait for the round's end; raise its first
        error. The caller's stream(s) wait for the copies back."""
        if self._finished:
            return
        self._finished = True
        inner = self.inner
        failure: BaseException | None = None
        try:
            self._after_caller()
            rest = sorted(i for i in self._chunks if i not in self._handed and i != self._held)
            if self._held is not None and self._held not in self._handed:
                rest.append(self._held)
            if rest:
                event = self._copy_out(r for i in rest for r in self._pieces(i))
                self._handed.update(rest)
                self._feeds.append(self.stager.feeder().submit(self._hand, event, rest))
            for fut in self._feeds:
                exc = fut.exception()
                if exc is not None and failure is None:
                    failure = exc
        finally:
            ended = self.stager.rounds().submit(inner.finish)   # reports a stall, releases the collective
        event = None
        try:
            for index, futures in list(self.launched):
                wait_futures(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in futures if f.done()):
                    break
                if not all(f.done() for f in futures):
                    break
                event = self._copy_back(index) or event
            ended.result()
            if failure is not None:
                raise failure
        finally:
            for stream in self.streams:
                self.lane.release_to(stream)
            self.lane.keep(self.data)
            self.stager.unmirror(self.mirror, event)

    def _copy_back(self, index: int) -> Any:
        event = None
        for off, n in self._pieces(index):
            for a, b in self.stager.spans(n):
                event = self.lane.copy(self.raw[off + a:off + b], self.mirror[off + a:off + b])
        return event


def begin(coll: Any, data: Any, dtype: Any = None, runs: Sequence[tuple[int, int]] | None = None,
          hold: int | None = None, wire: Any = None, full_sum: bool = False,
          stager: Stager | None = None) -> StagedRound:
    """:meth:`Collective.begin <smb_client.collective.Collective.begin>` of a CUDA tensor."""
    if not data.is_contiguous():
        raise InvalidArgument("an all-reduce needs a contiguous tensor")
    return StagedRound(stager or stager_for(data), coll, data, dtype, runs, hold, wire, full_sum)


def broadcast(coll: Any, data: B, root: int, rank: int, dtype: Any = None,
              stager: Stager | None = None) -> B:
    """:meth:`Collective.broadcast <smb_client.collective.Collective.broadcast>` of a
    CUDA tensor: the root copies it to the host and pushes it; the others pull it into a
    host copy and copy that to the device."""
    t: Any = data
    if not t.is_contiguous():
        raise InvalidArgument("a broadcast needs a contiguous tensor")
    st = stager or stager_for(t)
    if rank == root:
        host, mirror = st.to_host(t)
        try:
            coll.broadcast(host, root, rank, dtype)
        finally:
            st.unmirror(mirror)
        return data
    mirror = st.mirror(_nbytes(t))
    try:
        coll.broadcast(_host_view(mirror, t.dtype), root, rank, dtype)
    except BaseException:
        st.unmirror(mirror)
        raise
    st.to_device(mirror, t)
    return data
