"""The two gradient exchanges of :class:`~smb_client.torch.sync.SyncDataParallel`, and
the step parts they share (the step barrier, the buffers).

Both are :class:`Exchange` objects: the backward hooks hand them each bucket whose
gradients are final (:meth:`Exchange.bucket_ready`), and ``synchronize()`` begins and
finishes the step through them (:meth:`Exchange.begin_step`, :meth:`Exchange.finish_step`).

:class:`SlotsExchange` (``exchange="slots"``). The store has three gradient slots used
in turn: step ``s`` accumulates into slot ``s % 3``. Between the barriers of steps
``s-1`` and ``s`` every worker zeroes its share of slot ``(s+1) % 3``. That slot was
last read in step ``s-2``, which every worker finished before it pushed in step ``s-1``
(and so before barrier ``s-1`` opened); nobody accumulates into it before step ``s+1``,
which starts only after barrier ``s`` opened, which needs every worker's zeroing done.
One barrier per step, and the zeroing is spread over all workers.

:class:`CollectiveExchange` (``exchange="collective"``) sums the gradients with the
memory box's pipelined push-pull (:class:`~smb_client.collective.Collective`, over the
region ``<prefix>/allreduce``): each chunk is pushed as soon as its gradients are final
and pulled as soon as every worker's share arrived, while later chunks are still
pushed; no gradient slot, no zeroing, and no barrier per step unless buffers are
synchronized. Chunks that hold only frozen parameters are skipped. Aligned stopping
still holds: every worker publishes its count before it pushes the chunk it holds back
until ``synchronize()``, and reads the stop word after the last pull, so everybody's
count is visible to everybody by then.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from smb_protocol.errors import InvalidArgument, RegionNotFound
from smb_protocol.hostinfo import host_id

from ..collective import Collective
from ..collective_round import AllReduce
from ..coord import Attendance, Barrier, controller_barrier
from ..cuda_round import StagedRound
from ..futures import wait_all
from .counters import SYNC_BARRIER_WORD, SharedCounters
from .steps import StepTimes
from .store import ParameterStore
from .store_plan import SYNC_SLOTS

log = logging.getLogger(__name__)

Runs = list[tuple[int, int]]   # (byte offset, bytes) ranges of a gradient slot


@dataclass
class StepEnd:
    """One step's synchronization, as the trainer hands it to :meth:`Exchange.finish_step`."""

    step: int                       # the steps synchronized before this one
    pending: list[Future[Any]]      # sent ahead (zeroing, publishing, the hooks' pushes)
    hooked: bool                    # the backward hooks pushed the buckets (else none went out yet)
    sent: bool = False              # set once ``pending`` completed
    started: float = 0.0            # time.perf_counter() when the step's waiting began


class Exchange(Protocol):
    """How the workers sum their gradients, step by step."""

    def bucket_ready(self, step: int, offset: int, length: int) -> list[Future[Any]]:
        """Bytes ``[offset, offset+length)`` of the flat gradients are final in ``step``:
        send them; returns the operations to wait for."""

    def begin_step(self, step: int) -> list[Future[Any]]:
        """``synchronize()`` begins ending ``step`` (before the buckets still waiting are
        pushed): what goes out first; returns the operations to wait for."""

    def finish_step(self, end: StepEnd) -> None:
        """Push what is left, wait for ``end.pending`` and every worker, and leave the
        average over all workers in the flat gradients (the buffers synchronized too)."""

    def close(self) -> None:
        """Drop a round begun without ``synchronize()`` and close what the exchange opened."""


class Zeros:
    """Zero bytes to write: one buffer, grown to the largest length asked for."""

    def __init__(self) -> None:
        self._cache: memoryview | None = None

    def __call__(self, nbytes: int) -> memoryview:
        """``nbytes`` zero bytes."""
        if self._cache is None or len(self._cache) < nbytes:
            self._cache = memoryview(bytes(nbytes))
        return self._cache[:nbytes]


class StepBarrier:
    """The step's meeting of all ``world`` workers. The first meets at the controller's
    barrier ``name``, after rank 0 zeroed the memory box's barrier word (and, with
    ``reset_roll``, the attendance ``roll``); every later one meets on that word
    (:class:`~smb_client.coord.Barrier`), so steady-state steps call no controller.
    ``timeout`` gives the seconds to wait, asked at each meeting (the trainer's
    ``barrier_timeout``, which its caller may change between steps)."""

    def __init__(self, store: ParameterStore, rank: int, world: int, name: str, *, timeout: Callable[[], float],
                 roll: Attendance | None, reset_roll: bool) -> None:
        self.store, self.rank, self.world, self.name, self.timeout = store, rank, world, name, timeout
        self.roll = roll
        self.reset_roll = reset_roll
        self._barrier = Barrier(store.region("counters"), SYNC_BARRIER_WORD * 8, world,
                                name=f"barrier {store.prefix}/step", roll=roll)
        self._ready = False                # the first meeting zeroes the word

    def meet(self) -> None:
        """Wait for every worker (up to ``timeout()`` seconds)."""
        if self._ready:
            self._barrier.wait(timeout=self.timeout())
            return
        if self.rank == 0:
            self.store.region("counters").write(SYNC_BARRIER_WORD * 8, bytes(8))
            if self.roll is not None and self.reset_roll:
                self.roll.reset()
        controller_barrier(self.store.client, self.name, self.world, timeout=self.timeout(), rank=self.rank)
        self._ready = True


class BufferSync:
    """The model's buffers kept equal each step through the store's ``buffers`` region,
    slot ``1 + s % 3`` in step ``s`` (``mode``: ``broadcast``, ``average`` or ``none``;
    see :mod:`smb_client.torch.sync`)."""

    def __init__(self, store: ParameterStore, rank: int, world: int, mode: str, zeros: Zeros) -> None:
        self.store, self.rank, self.world, self.mode, self.zeros = store, rank, world, mode, zeros

    def push(self, step: int) -> list[Future[Any]]:
        """Before the barrier: ``step``'s buffer slot filled; returns the operations."""
        store = self.store
        if self.mode == "none":
            return []
        slot = 1 + step % SYNC_SLOTS
        region = store.region("buffers")
        out: list[Future[Any]] = []
        sent = 0
        if self.rank == 0:
            written = [(off, b.detach().contiguous()) for off, b in store.buffer_items(slot)
                       if self.mode == "broadcast" or not b.is_floating_point()]
            if written:
                out.append(region.write_many_async(written))
                sent += sum(b.numel() * b.element_size() for _, b in written)
            if self.mode == "average":
                nxt = store.buffer_offset(1 + (step + 1) % SYNC_SLOTS)
                assert store.buffer_layout is not None
                out.append(region.write_async(nxt, self.zeros(store.buffer_layout.slot_bytes)))
                sent += store.buffer_layout.slot_bytes
        if self.mode == "average":
            summed = [(off, b.detach().contiguous()) for off, b in store.buffer_items(slot, floating_only=True)]
            if summed:
                out.append(region.accumulate_many_async(summed))
                sent += sum(b.numel() * b.element_size() for _, b in summed)
        if out:
            store.count_traffic(sent=sent)
        return out

    def pull(self, step: int) -> None:
        """After the barrier: ``step``'s synchronized buffers into the model."""
        if self.mode == "none" or (self.mode == "broadcast" and self.rank == 0):
            return
        self.store.pull_buffers(1 + step % SYNC_SLOTS)
        if self.mode == "average":
            with torch.no_grad():
                for b in self.store.buffers:
                    if b.is_floating_point():
                        b.mul_(1.0 / self.world)


@dataclass
class StepParts:
    """The parts of a step both exchanges use."""

    counters: SharedCounters | None   # lockstep counters: every step published (see sync.py)
    times: StepTimes
    buffers: BufferSync
    barrier: StepBarrier


class SlotsExchange:
    """Accumulate into the step's gradient slot, meet, read the sum back (see the
    module's notes). ``runs``: the trainable byte ranges of a slot; ``share``: this
    worker's part of them, which it zeroes in the next slot."""

    def __init__(self, store: ParameterStore, world: int, runs: Runs, share: Runs, zeros: Zeros,
                 parts: StepParts) -> None:
        self.store, self.flat, self.world, self.runs, self.share = store, store.flat, world, runs, share
        self.zeros, self.parts = zeros, parts

    def bucket_ready(self, step: int, offset: int, length: int) -> list[Future[Any]]:
        """Accumulate the bucket into ``step``'s slot."""
        base = self.store.slot_offset("grads", step % SYNC_SLOTS)
        return self.store.accumulate_flat("grads", base, self.flat.flat_grads, offset, length)

    def begin_step(self, step: int) -> list[Future[Any]]:
        """Zero this worker's share of the next step's slot."""
        nxt = self.store.slot_offset("grads", (step + 1) % SYNC_SLOTS)
        return [self.store.write_async("grads", nxt + off, self.zeros(n)) for off, n in self.share]

    def finish_step(self, end: StepEnd) -> None:
        """Push, meet, read the sum."""
        store, flat, parts = self.store, self.flat, self.parts
        times = parts.times
        if not end.hooked:
            for off, n in self.runs:
                end.pending.extend(self.bucket_ready(end.step, off, n))
        end.pending.extend(parts.buffers.push(end.step))
        end.started = time.perf_counter()
        with times.phase("push"):
            wait_all(end.pending)
        end.sent = True
        with times.phase("barrier"):
            if parts.counters is not None:
                parts.counters.publish()
            parts.barrier.meet()
        with times.phase("sum"):
            base = store.slot_offset("grads", end.step % SYNC_SLOTS)
            for off, n in self.runs:
                store.read_into("grads", base + off, flat.byte_range(flat.flat_grads, off, n))
            flat.scale_(flat.flat_grads, 1.0 / self.world)
            parts.buffers.pull(end.step)

    def close(self) -> None:
        """Nothing to close."""


def gather_worker_hosts(given: Sequence[str] | None, world: int) -> list[str] | None:
    """Every worker's host id: ``given``, or gathered through torch.distributed when it
    is initialized over ``world`` processes; None when unknown."""
    if given is not None:
        if given and len(given) != world:
            raise InvalidArgument(f"worker_hosts names {len(given)} hosts for {world} workers")
        return list(given) or None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world):
        return None
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, host_id())
    return [str(h) for h in hosts]


class CollectiveExchange:
    """One collective round per step over ``coll`` (see the module's notes); the round
    holds back the chunk of the last trainable range until :meth:`finish_step`."""

    def __init__(self, coll: Collective, store: ParameterStore, world: int, runs: Runs, parts: StepParts, *,
                 wire: str | None, full_sum: bool) -> None:
        self.coll, self.store, self.flat, self.world, self.runs = coll, store, store.flat, world, runs
        self.parts, self.wire, self.full_sum = parts, wire, full_sum
        # held back until synchronize(): see the module's notes on aligned stopping
        self._hold = runs[-1][0] if runs else None
        self._round: AllReduce | StagedRound | None = None

    @staticmethod
    def open(store: ParameterStore, rank: int, world: int, runs: Runs, *, roll: Attendance | None,
             priority: bool, timeout: float, hosts: list[str] | None) -> Collective:
        """Rank 0 makes ``<prefix>/allreduce`` afresh (its counts must start at zero),
        its chunks placed by ``hosts`` when known; the others open it after a controller
        barrier (once, not per step)."""
        name = store.region_name(store.prefix, "allreduce")
        coll = None
        if rank == 0:
            try:
                store.client.delete_region(name)
            except RegionNotFound:
                pass
            packed = max(8, sum(n for _, n in runs))   # only trainable bytes travel
            coll = Collective.create(store.client, name, packed, world, timeout=timeout,
                                     worker_hosts=hosts, priority=priority, lease=store.lease)
            if roll is not None:   # nobody waits yet: everybody is at the barrier below
                roll.reset()
        controller_barrier(store.client, f"{store.prefix}/allreduce", world, timeout=timeout, rank=rank)
        if coll is None:
            coll = Collective.open(store.client, name, world, timeout=timeout, fresh=True, priority=priority)
        coll.roll = roll
        return coll

    def _begin_round(self) -> AllReduce | StagedRound:
        if self._round is None:
            self._round = self.coll.begin(self.flat.flat_grads, runs=self.runs, hold=self._hold,
                                          wire=self.wire, full_sum=self.full_sum)
        return self._round

    def bucket_ready(self, step: int, offset: int, length: int) -> list[Future[Any]]:
        """The chunks whose gradients are all final go out."""
        self._begin_round().ready(offset, length)
        return []

    def begin_step(self, step: int) -> list[Future[Any]]:
        """Nothing goes out ahead."""
        return []

    def finish_step(self, end: StepEnd) -> None:
        """Publish the count, end the round, then the buffers."""
        end.started = time.perf_counter()
        parts = self.parts
        times = parts.times
        if parts.counters is not None:     # before the held-back chunk: see the module's notes
            parts.counters.publish()
        rnd = self._begin_round()
        self._round = None
        with times.phase("sum"):           # the last pushes and every chunk's sum
            try:
                if not end.hooked:
                    for off, n in self.runs:
                        rnd.ready(off, n)
            finally:
                rnd.finish()
        self.store.count_traffic(sent=sum(n for _, n in self.runs), received=sum(n for _, n in self.runs))
        self.flat.scale_(self.flat.flat_grads, 1.0 / self.world)
        end.pending.extend(parts.buffers.push(end.step))
        with times.phase("push"):
            wait_all(end.pending)
        end.sent = True
        if parts.buffers.mode != "none":
            with times.phase("barrier"):
                parts.barrier.meet()
            with times.phase("sum"):
                parts.buffers.pull(end.step)

    def close(self) -> None:
        """Drop a round begun without ``synchronize()`` and close the collective."""
        self._round = None
        self.coll.close()
