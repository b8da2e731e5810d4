"""Collectives over a region: ``all_reduce`` with sums streamed back, and ``broadcast``.

A :class:`Collective` lays a buffer of ``nbytes`` out as chunks of at most
:data:`~smb_protocol.wire.MAX_CHUNK` bytes, each a segment of a ``layered`` region, whole
on one memory server (:mod:`.collective_layout`), so the summation is spread over the
servers and each chunk's requests stay on one server. A round whose bytes become final
piece by piece is a :class:`~smb_client.collective_round.AllReduce`.

Round ``k`` (every ``all_reduce`` and ``broadcast`` is one, numbered from 0 by every
party alike) uses slot ``k % 2``. Every party *pushes* each chunk (the server stores the
round's first arrival and adds the others, counting arrivals in the slot's count word,
under the extent's lock), and *pulls* its sum once the count shows every party's push
(the server sends it then, and counts the pull). Both halves travel
as one ``REDUCE`` per chunk on a pipelined connection per server (a queue pair where the
region's data goes over rdma: pushes written one-sided into the server's staging area,
sums written back into the caller's buffers; else a tcp socket), the sum sent back by
the server unasked (:mod:`.exchange`: chunks in order through a window, lowest first);
``pipelined=False`` and TLS endpoints send a ``PUSH`` and a ``PULL`` request instead.
Later chunks go out while earlier sums come back, so both directions of every link
stay busy; there is no barrier between the phases and no controller call.

The server knows the round. A count word names the round its slot holds and how many
pushes and pulls of it arrived (:mod:`smb_protocol.rounds`), and every push and pull
names its round. The round's first push *stores* instead of adding, so nobody zeroes the
slot; a push of a later round waits, at the server, until every party pulled the slot's
previous round, so a slot is never overwritten while someone still reads it; a push or
pull of a round the slot is past, or one too many, is refused with
:class:`~smb_protocol.errors.RoundMismatch`, never added into another round's sum.
Double buffering (two slots) makes the wait free in steady state.

Parties may open the collective at any moment, in any order: every party starts at
round 0, and the group cannot finish a round without every party, so a party that
opens late joins the round the others wait in. A party counts itself into the
collective's ``members`` word at its first round; one beyond ``parties`` (a party that
came back after a restart, or a second object of the same party) is refused with
RoundMismatch before it sends anything.

Every party must call the same collectives in the same order with the same sizes (as
with any collective library). Chunk requests are numbered: a retry after a broken
connection or a renewed ticket is answered, not applied twice. They travel on the tcp
plane, whatever transport the region's data uses, with the route's ticket and
incarnation check (:meth:`Route.coordinate <smb_client.route.Route.coordinate>` for
push and pull). A round that fails (a server died) fails at once on every party and
leaves the collective unusable (:attr:`Collective.failed`). A round that waits longer
than :data:`~smb_client.coord.REPORT_EVERY` seconds logs how many parties arrived (and,
with a :attr:`Collective.roll`, which ranks did not), and one that times out raises
:class:`~smb_client.coord.PartiesMissing`. See docs/api.md and docs/architecture.md.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from smb_protocol.chunk_types import ChunkTypes, wire_type
from smb_protocol.errors import InvalidArgument, RoundMismatch, SMBError, Timeout
from smb_protocol.rounds import ChunkRound

from . import collective_layout as chunking
from . import cuda, cuda_round
from .buffers import typed_view
from .client import Client
from .collective_layout import CHUNK_BYTES, MEMBERS, TAIL, check_parties
from .collective_round import AllReduce
from .coord import REPORT_EVERY, PartiesMissing, Roll, ranks_text, report_waiting
from .exchange import Chunk, Exchanger, exchange_transport
from .futures import wait_all, watch
from .metrics import timed_method
from .region import Region
from .wire_chunk import WireChunk

log = logging.getLogger(__name__)

__all__ = ["Collective", "CHUNK_BYTES"]

B = TypeVar("B")    # the caller's buffer (numpy array, torch CPU tensor, writable buffer), returned as given

WINDOW_CHUNKS = 4              # default window: bytes in flight, in chunks
DEFAULT_TIMEOUT = 300.0        # seconds a push or pull waits for the other parties
MAX_THREADS = 8                # pushes (and pulls) in flight per collective


class Collective:
    """All-reduce and broadcast among ``parties`` processes over the region ``region``
    (made by :meth:`create`, opened by :meth:`open`). Borrows the region's client;
    :meth:`close` stops its threads, :meth:`destroy` also deletes the region.

    ``timeout``: seconds a chunk waits for the other parties (then
    :class:`~smb_client.coord.PartiesMissing`, a :class:`~smb_protocol.errors.Timeout`).
    :attr:`roll` (set by the caller; None: ranks unknown) names the ranks a stalled
    round waits for; :attr:`report_every`: seconds between its reports. ``transport``:
    see :func:`~smb_client.exchange.exchange_transport`.
    """

    def __init__(self, region: Region, parties: int, *, timeout: float = DEFAULT_TIMEOUT,
                 fresh: bool = True, window: int | None = None, priority: bool = True,
                 pipelined: bool = True, transport: str | None = None) -> None:
        check_parties(parties)
        layout = region.layout
        if layout.kind != "layered" or any(s <= TAIL or (s - TAIL) % 2 for s in layout.segment_sizes):
            raise InvalidArgument(f"region {region.name} is not a collective's (made by Collective.create)")
        region.route.check_writable()
        self.transport = exchange_transport(transport)
        self.region = region
        self.parties = parties
        self.timeout = float(timeout)
        self.chunks: list[Chunk] = []
        self.failed: SMBError | None = None   # a round failed: the counts are not known any more
        start = 0
        for i, (seg_off, size) in enumerate(zip(layout.segment_offsets(), layout.segment_sizes, strict=True)):
            (piece,) = layout.map(seg_off, size)
            length = (size - TAIL) // 2
            self.chunks.append(Chunk(i, piece.extent, region.extents[piece.extent], piece.extent_offset,
                                      seg_off, start, length))
            start += length
        self.nbytes = start
        del fresh   # every party starts at round 0; the server checks the rounds
        self.round = 0
        self._joined = False
        threads = max(1, min(len(self.chunks), MAX_THREADS))
        self._pushes = ThreadPoolExecutor(threads, thread_name_prefix="smb-push")
        self._pulls = ThreadPoolExecutor(threads, thread_name_prefix="smb-pull")
        longest = max(c.length for c in self.chunks)
        self.window = WINDOW_CHUNKS * longest if window is None else int(window)
        if self.window < 1:
            raise InvalidArgument(f"window must be a positive number of bytes, not {window!r}")
        # pipelined streams where every server's session has one (not over TLS, whose
        # collectives push and pull on pooled connections)
        self.streaming = pipelined and all(
            region.route.stream(c.slot, self.transport == "auto")[0] is not None
            for c in {c.place.server_id: c for c in self.chunks}.values())
        self.exchanger = Exchanger(self, self.window, priority) if self.streaming else None
        #: held by one round at a time (an AllReduce holds it until it finishes)
        self.lock = threading.Lock()
        self.roll: Roll | None = None
        self.report_every = REPORT_EVERY

    # -- making and opening -----------------------------------------------------------
    segment_sizes = staticmethod(chunking.segment_sizes)
    default_chunk = staticmethod(chunking.default_chunk)
    server_weights = staticmethod(chunking.server_weights)

    @classmethod
    def create(cls, client: Client, name: str, nbytes: int, parties: int, *,
               chunk_bytes: int | None = None, num_servers: int = 0,
               timeout: float = DEFAULT_TIMEOUT, worker_hosts: Sequence[str] | None = None,
               servers: Sequence[str] | Mapping[str, float] | None = None,
               window: int | None = None, priority: bool = True, pipelined: bool = True,
               lease: float | None = None, transport: str | None = None) -> Collective:
        """Create the region ``name`` for collectives of up to ``nbytes`` bytes, chunks
        of ``chunk_bytes`` (default :meth:`default_chunk`) dealt over ``num_servers``
        servers (0: all that are up).

        Placement by where the workers run: ``worker_hosts``, the host id of every
        party (:func:`smb_protocol.hostinfo.host_id`), gives each server a share of the
        chunks by :func:`smb_protocol.placement.chunk_shares` (servers on hosts of their
        own first; one on a worker's host gets less, as its link also carries that
        worker's traffic). ``servers``: the server ids to use (with ``worker_hosts``,
        shared as above; without, evenly), or a mapping server id -> weight that
        fixes the shares. Either excludes ``num_servers``. ``lease`` (seconds): the
        region goes with ``client`` (see :meth:`Client.create_region
        <smb_client.client.Client.create_region>`)."""
        weights = chunking.server_weights(client, worker_hosts, servers)
        if weights is not None and num_servers:
            raise InvalidArgument("num_servers excludes worker_hosts and servers: those choose the servers")
        if chunk_bytes is None:
            chunk_bytes = chunking.chunk_bytes_for(client, nbytes, weights, num_servers)
        sizes = cls.segment_sizes(nbytes, chunk_bytes)
        check_parties(parties)
        region = client.create_region(name, sum(sizes), placement="layered", segment_sizes=sizes,
                                      num_servers=num_servers, server_weights=weights, lease=lease)
        try:
            return cls(region, parties, timeout=timeout, fresh=True, window=window, priority=priority,
                       pipelined=pipelined, transport=transport)
        except BaseException:
            client.delete_region(name)
            raise

    @classmethod
    def open(cls, client: Client, name: str, parties: int, *, timeout: float = DEFAULT_TIMEOUT,
             fresh: bool = True, window: int | None = None, priority: bool = True,
             pipelined: bool = True, transport: str | None = None) -> Collective:
        """Open the collective ``name`` that another party created, at any moment: this
        party starts at round 0 with the others, and a late one joins the round they
        wait in. A party beyond ``parties`` (one that came back after a restart) gets
        :class:`~smb_protocol.errors.RoundMismatch` at its first round; so does one whose
        group already went past round 0 without it. ``fresh`` is accepted for older
        callers and changes nothing: no value of it can make a sum wrong."""
        return cls(client.open_region(name), parties, timeout=timeout, fresh=fresh, window=window,
                   priority=priority, pipelined=pipelined, transport=transport)

    def close(self) -> None:
        """Stop this party's threads (after the work in flight); the region stays."""
        if self.exchanger is not None:
            self.exchanger.close()
        self._pushes.shutdown(wait=True)
        self._pulls.shutdown(wait=True)

    def destroy(self) -> None:
        """Close, then delete the region (every party must be done with it)."""
        self.close()
        self.region.client.delete_region(self.region.name)

    def __enter__(self) -> Collective:
        """The collective itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close` (the region stays)."""
        self.close()

    # -- requests ---------------------------------------------------------------------
    def _ref(self, chunk: Chunk, round_: int, root: bool = False) -> ChunkRound:
        """Round ``round_`` of ``chunk``, as its requests name it."""
        return ChunkRound(chunk.words[round_ % 2], self.parties, round_, root)

    def _push(self, chunk: Chunk, round_: int, data: list[memoryview], types: ChunkTypes,
              root: bool = False) -> None:
        route = self.region.route
        seq = route.next_seq()
        ref = self._ref(chunk, round_, root)
        code = types.code()
        route.coordinate(chunk.slot, lambda s, place: s.push(
            route.ticket, place.extent_id, chunk.slots[round_ % 2], data, code, ref, self.timeout, seq))

    def _pull(self, chunk: Chunk, round_: int, out: list[memoryview], wire_chunk: WireChunk | None = None) -> None:
        """Pull ``chunk``'s sum of round ``round_`` into ``out`` (through ``wire_chunk``
        when it travels in a wire type)."""
        route = self.region.route
        seq = route.next_seq()
        ref = self._ref(chunk, round_)
        w = wire_chunk
        into, code, length = (out, 0, None) if w is None else (w.into, w.types.code(), w.nbytes)
        route.coordinate(chunk.slot, lambda s, place: s.pull(
            route.ticket, place.extent_id, chunk.slots[round_ % 2], into, ref, self.timeout, seq, code, length))
        if w is not None:
            w.received()

    def _join(self) -> None:
        """Count this party into the collective's members, once, before its first round
        (hold :attr:`lock`); RoundMismatch when it already has its ``parties``."""
        if self._joined:
            return
        before = self.region.fetch_add(self.chunks[0].region_words + MEMBERS, 1)
        if before >= self.parties:
            raise RoundMismatch(
                f"collective {self.region.name} already has its {self.parties} parties ({before} joined "
                "before this one): a party that came back after a restart, or a second Collective "
                "object of one party, cannot join it; every party must make a new collective "
                "(a new name) to start over")
        self._joined = True

    def _run(self, jobs: list[tuple[ThreadPoolExecutor, Callable[[], None]]], what: str) -> None:
        """Submit every job in order (pushes before the pull of the same chunk); wait for
        all, reporting a wait that lasts; raise the first error (a timeout as
        :class:`~smb_client.coord.PartiesMissing`)."""
        if self.roll is not None:
            self.roll.arrive()
        futures = [pool.submit(fn) for pool, fn in jobs]
        started = time.monotonic()
        missing: Callable[[], list[int] | None] = self.roll.missing if self.roll is not None else lambda: None
        watch(futures, self.report_every, lambda: report_waiting(
            what, time.monotonic() - started, None, self.parties, missing()))
        try:
            wait_all(futures)
        except Timeout as exc:
            ranks = missing()
            raise PartiesMissing(f"{what}: not every party came within {time.monotonic() - started:.0f} s"
                                 f"{ranks_text(ranks)} ({exc})", what=what, parties=self.parties,
                                 missing=ranks) from None

    def plan_round(self, nbytes: int) -> tuple[int, list[tuple[Chunk, int]]]:
        """Start the next all-reduce round (hold :attr:`lock`): its number, and the
        chunks a packed buffer of ``nbytes`` covers, each with the bytes of it used."""
        self._join()
        round_ = self.round
        self.round += 1
        return round_, self._used(nbytes)

    def exchange(self, chunk: Chunk, round_: int, parts: list[memoryview], types: ChunkTypes) -> list[Future[None]]:
        """Push ``parts`` as ``chunk``'s share of round ``round_`` (travelling as
        ``types`` say), and have the sum in them once every party pushed: streamed back
        on a pipelined connection (:mod:`.exchange`), or pulled; the futures."""
        if self.exchanger is not None:
            return [self.exchanger.submit(chunk, round_, parts, types)]
        w = WireChunk(parts, types) if types.wire else None
        return [self._pushes.submit(self._push, chunk, round_, parts if w is None else w.sent, types),
                self._pulls.submit(self._pull, chunk, round_, parts, w)]

    def _check_usable(self) -> None:
        """A collective whose round failed part way cannot go on: its counts are unknown."""
        if self.failed is not None:
            raise type(self.failed)(f"collective {self.region.name} failed in round {self.round - 1} "
                                    f"({self.failed}); every party must make a new one")

    def _used(self, nbytes: int) -> list[tuple[Chunk, int]]:
        """The chunks a buffer of ``nbytes`` covers, with the bytes of each it uses."""
        out = []
        for c in self.chunks:
            if c.start >= nbytes:
                break
            out.append((c, min(c.length, nbytes - c.start)))
        return out

    # -- collectives ------------------------------------------------------------------
    @timed_method("reduce")
    def all_reduce(self, data: B, dtype: Any = None, *, wire: Any = None, full_sum: bool = False) -> B:
        """Sum ``data`` (a writable numpy array, torch CPU tensor or buffer; float32,
        float16, bfloat16, float64, int32 or int64) over the parties, in place; returns
        ``data``. Chunks are pushed in order while the finished ones are pulled.

        ``wire``: ``"bf16"`` or ``"fp16"`` sends a float32 buffer's chunks as 16-bit
        values (half the bytes); the servers sum them in float32, and the sum comes
        back rounded once to the wire type, or, with ``full_sum``, as float32 (twice the
        return bytes, never rounded). Every party must pass the same."""
        self.begin(data, dtype, wire=wire, full_sum=full_sum).finish()
        return data

    def begin(self, data: Any, dtype: Any = None, *, runs: Sequence[tuple[int, int]] | None = None,
              hold: int | None = None, wire: Any = None,
              full_sum: bool = False) -> AllReduce | cuda_round.StagedRound:
        """Start an all-reduce of ``data`` (as :meth:`all_reduce`) whose bytes become
        final piece by piece: call :meth:`AllReduce.ready` as they do (each chunk is
        pushed once all its bytes are), then :meth:`AllReduce.finish`. ``runs``:
        ``(offset, length)`` byte ranges that take part (default: all of ``data``);
        chunks outside them are neither pushed nor pulled (every party must pass the
        same; only their bytes travel, packed). ``hold``: the offset of a byte whose chunk
        is pushed only by ``finish``
        (the round's end can then not be seen by anyone before every party called it).
        A CUDA tensor's round is staged through pinned host memory (:mod:`.cuda_round`).
        ``wire``, ``full_sum``: as for :meth:`all_reduce`."""
        if cuda.is_cuda(data):
            return cuda_round.begin(self, data, dtype, runs, hold, wire, full_sum)
        view, dt = typed_view(data, dtype, writable=True)
        types = ChunkTypes(dt, wire_type(wire), full_sum)
        self.lock.acquire()
        try:
            self._check_usable()
            return AllReduce(self, view, types, runs, hold)
        except BaseException:
            self.lock.release()
            raise

    @timed_method("broadcast")
    def broadcast(self, data: B, root: int, rank: int, dtype: Any = None) -> B:
        """Give every party ``root``'s ``data`` (in place at the others); ``rank`` is
        this party's rank among ``0 .. parties-1``. Returns ``data``."""
        if not (0 <= root < self.parties and 0 <= rank < self.parties):
            raise InvalidArgument(f"root {root} and rank {rank} must lie in 0..{self.parties - 1}")
        if cuda.is_cuda(data):
            return cuda_round.broadcast(self, data, root, rank, dtype)
        view, dt = typed_view(data, dtype, writable=True)
        if len(view) > self.nbytes:
            raise InvalidArgument(f"{len(view)} bytes do not fit collective {self.region.name} "
                                  f"({self.nbytes} bytes)")
        with self.lock:
            self._check_usable()
            self._join()
            round_ = self.round
            self.round += 1
            jobs: list[tuple[ThreadPoolExecutor, Callable[[], None]]] = []
            for c, n in self._used(len(view)):
                part = view[c.start:c.start + n]
                if rank == root:
                    jobs.append((self._pushes, partial(self._push, c, round_, [part], ChunkTypes(dt), True)))
                else:
                    jobs.append((self._pulls, partial(self._pull, c, round_, [part])))
            try:
                self._run(jobs, f"broadcast from rank {root} on {self.region.name}, round {round_}")
            except SMBError as exc:
                self.failed = exc
                raise
        return data

    # -- asyncio ----------------------------------------------------------------------
    async def aall_reduce(self, data: B, dtype: Any = None) -> B:
        """:meth:`all_reduce` as a coroutine: the round runs in a thread of the event
        loop's default executor (:func:`asyncio.to_thread`) while the loop goes on. A
        cancelled await returns at once; the round still runs to its end (every party
        takes part in it), and ``data`` then holds the sum."""
        return await asyncio.to_thread(self.all_reduce, data, dtype)

    async def abroadcast(self, data: B, root: int, rank: int, dtype: Any = None) -> B:
        """:meth:`broadcast` as a coroutine, run as :meth:`aall_reduce` runs."""
        return await asyncio.to_thread(self.broadcast, data, root, rank, dtype)
