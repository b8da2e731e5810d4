"""One all-reduce round whose bytes become final piece by piece
(:meth:`Collective.begin <smb_client.collective.Collective.begin>`): each chunk is pushed
as soon as all of its bytes are ready, the rest at :meth:`AllReduce.finish`, and only
the bytes of the round's runs travel, packed.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.errors import InvalidArgument, SMBError, Timeout
from smb_protocol.rounds import arrivals, slot_round

from .coord import PartiesMissing, Roll, ranks_text, report_waiting
from .exchange import Chunk, Exchanger
from .futures import wait_failing_fast, watch

if TYPE_CHECKING:
    import threading

    from .region import Region


class Rounds(Protocol):
    """What a round needs of its :class:`~smb_client.collective.Collective`."""

    region: Region
    parties: int
    nbytes: int
    chunks: list[Chunk]
    lock: threading.Lock
    roll: Roll | None
    report_every: float
    exchanger: Exchanger | None
    failed: SMBError | None

    def plan_round(self, nbytes: int) -> tuple[int, list[tuple[Chunk, int]]]: ...

    def exchange(self, chunk: Chunk, round_: int, parts: list[memoryview],
                 types: ChunkTypes) -> list[Future[None]]: ...

__all__ = ["AllReduce"]


class AllReduce:
    """One all-reduce round of a :class:`~smb_client.collective.Collective` (from
    :meth:`Collective.begin <smb_client.collective.Collective.begin>`):
    holds the collective until :meth:`finish`.

    The round reduces the bytes of ``runs`` only, packed one after the other: chunk
    ``i`` of the collective covers packed bytes ``[start, start+length)``, gathered from
    (and scattered back to) the runs' pieces of the caller's buffer, so bytes outside
    the runs (frozen parameters) cost no traffic.
    """

    def __init__(self, coll: Rounds, view: memoryview, types: ChunkTypes,
                 runs: Sequence[tuple[int, int]] | None, hold: int | None) -> None:
        self.coll = coll
        self.view = view
        self.types = types
        runs = [(0, len(view))] if runs is None else sorted((o, n) for o, n in runs if n > 0)
        self.runs: list[tuple[int, int, int]] = []       # (buffer offset, length, packed offset)
        packed = 0
        for off, n in runs:
            if off < 0 or off + n > len(view) or (self.runs and off < self.runs[-1][0] + self.runs[-1][1]):
                raise InvalidArgument(f"runs must be disjoint byte ranges inside the buffer, got {runs}")
            self.runs.append((off, n, packed))
            packed += n
        if packed > coll.nbytes:
            raise InvalidArgument(f"{packed} bytes do not fit collective {coll.region.name} ({coll.nbytes} bytes)")
        self.futures: list[Future[None]] = []
        self._todo: dict[int, tuple[Chunk, int]] = {}
        self._missing: dict[int, int] = {}      # chunk index -> bytes not final yet
        self._held: int | None = None
        held = self._packed(hold) if hold is not None else None
        self._round, planned = coll.plan_round(packed)
        for c, n in planned:
            self._todo[c.index] = (c, n)
            self._missing[c.index] = n
            if held is not None and c.start <= held < c.start + n:
                self._held = c.index
        self._chunks = sorted(self._missing)
        self._finished = False

    def _packed(self, offset: int) -> int | None:
        for off, n, packed in self.runs:
            if off <= offset < off + n:
                return packed + offset - off
        return None

    def _pieces(self, lo: int, hi: int) -> list[memoryview]:
        """The caller's buffer pieces holding packed bytes ``[lo, hi)``, in order."""
        out = []
        for off, n, packed in self.runs:
            a, b = max(lo, packed), min(hi, packed + n)
            if a < b:
                out.append(self.view[off + a - packed:off + b - packed])
        return out

    def ready(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset+length)`` of the buffer are final (each byte once)."""
        for off, n, packed in self.runs:
            a, b = max(offset, off), min(offset + length, off + n)
            if a >= b:
                continue
            lo, hi = packed + a - off, packed + b - off
            for index, (c, cn) in list(self._todo.items()):
                got = min(hi, c.start + cn) - max(lo, c.start)
                if got > 0:
                    self._missing[index] -= got
                    if self._missing[index] <= 0 and index != self._held:
                        self._launch(index)

    def _launch(self, index: int) -> None:
        c, n = self._todo.pop(index)
        parts = self._pieces(c.start, c.start + n)
        self.futures.extend(self.coll.exchange(c, self._round, parts, self.types))

    def finish(self) -> None:
        """Push what is left (in chunk order), wait for every push and pull; raise the
        first error. Releases the collective."""
        if self._finished:
            return
        self._finished = True
        coll = self.coll
        try:
            if coll.roll is not None:
                coll.roll.arrive()
            for index in sorted(self._todo):
                self._launch(index)
            exchanger = coll.exchanger
            started = time.monotonic()
            try:
                watch(self.futures, coll.report_every, lambda: report_waiting(
                    self._what(), time.monotonic() - started, self._arrived(), coll.parties,
                    coll.roll.missing() if coll.roll is not None else None))
                wait_failing_fast(self.futures, exchanger.abandon if exchanger is not None else None)
            except Timeout as exc:
                arrived, missing = self._arrived(), coll.roll.missing() if coll.roll is not None else None
                what = self._what()
                coll.failed = PartiesMissing(
                    f"{what}: {arrived} of {coll.parties} parties arrived within "
                    f"{time.monotonic() - started:.0f} s{ranks_text(missing)} ({exc})",
                    what=what, arrived=arrived, parties=coll.parties, missing=missing)
                raise coll.failed from None
            except SMBError as exc:
                coll.failed = exc
                raise
        finally:
            coll.lock.release()

    def _what(self) -> str:
        return f"all-reduce on {self.coll.region.name}, round {self._round}"

    def _arrived(self) -> int | None:
        """How many parties pushed the round's last chunk (the one pushed at
        :meth:`finish`); None when its count cannot be read."""
        if not self._chunks:
            return None
        index = self._held if self._held is not None else self._chunks[-1]
        chunk = self.coll.chunks[index]
        try:
            raw = bytes(self.coll.region.read(chunk.region_words + 8 * (self._round % 2), 8))
        except SMBError:
            return None
        word = int.from_bytes(raw, "little", signed=True)
        if slot_round(word) != self._round:
            return 0
        return min(self.coll.parties, arrivals(word))
