"""Synchronous data parallelism through the memory box.

Every step each worker accumulates its gradients into a gradient slot of the store
(server-side ``+=``), all meet at a barrier, then each reads the summed
gradients back, divides by the number of workers and runs its own (identical)
optimizer step. All replicas stay equal to a single process training on the union of
the workers' batches.

Resetting the accumulation slot (``exchange="slots"``). The store has three gradient
slots used in turn: step ``s`` accumulates into slot ``s % 3``. Between the barriers of
steps ``s-1`` and ``s`` every worker zeroes its share of slot ``(s+1) % 3``. That slot was last read in
step ``s-2``, which every worker finished before it pushed in step ``s-1`` (and so
before barrier ``s-1`` opened); nobody accumulates into it before step ``s+1``, which
starts only after barrier ``s`` opened, which needs every worker's zeroing done. One
barrier per step, and the zeroing is spread over all workers.

With ``overlap=True`` gradients are pushed bucket by bucket from backward hooks as
asynchronous operations, so the communication of the last layers overlaps the backward
pass of the first ones, and the backward pass ends with the rest of the step's
synchronization (a callback queued on the autograd engine, as DDP's reducer does): the
DDP loop ``optimizer.zero_grad(); loss.backward(); optimizer.step()`` runs unchanged,
and an explicit :meth:`SyncDataParallel.synchronize` after it returns at once. Inside
:meth:`SyncDataParallel.no_sync` backward passes only accumulate locally (gradient
accumulation over micro-batches).

The barrier: the first step meets at the controller's ``Barrier`` (rank 0 zeroes the
barrier word of the ``counters`` region before it); every later step meets on that word
on its memory server (:class:`~smb_client.coord.Barrier`: ``fetch_add`` and a
server-side wait), so steady-state steps make no controller call. One
:class:`SyncDataParallel` drives a store at a time.

Frozen parameters (``requires_grad=False``) are neither pushed, pulled nor zeroed.

``exchange="collective"`` (the default ``auto`` picks it when every parameter has one
element type) sums the gradients with the memory box's pipelined push-pull instead
(:class:`~smb_client.collective.Collective`, over the region ``<prefix>/allreduce``):
each chunk is pushed as soon as its gradients are final (from the backward hooks) and
pulled as soon as every worker's share arrived, while later chunks are still pushed;
no gradient slot, no zeroing, and no barrier per step unless buffers are synchronized.
Chunks that hold only frozen parameters are skipped. Aligned stopping still holds:
every worker publishes its count before it pushes the chunk it holds back until
:meth:`SyncDataParallel.synchronize`, and reads the stop word after the last pull, so
everybody's count is visible to everybody by then. ``exchange="slots"`` keeps the
accumulate, barrier and read of the three gradient slots (needed for mixed element
types).

Buffers (batch-norm statistics) are synchronized every step through the store's
``buffers`` region, slot ``1 + s % 3`` in step ``s`` (the rotation argument above
holds for it too): ``broadcast`` (the default, as DDP) rank 0 writes its buffers
before the barrier and the others read them after it; ``average`` every worker
accumulates its floating-point buffers (integer ones, such as ``num_batches_tracked``,
come from rank 0), all read the sum after the barrier and divide by the number of
workers, and rank 0 zeroes the next slot; ``none`` leaves every replica its own.

Publishing. Every ``publish_every`` steps, and in :meth:`SyncDataParallel.close`, each
worker writes its share of the current weights (the same ``1/world`` byte range it
zeroes) into the ``params`` region, and rank 0 the buffers into buffer slot 0, so the
store holds the trained weights for evaluators, checkpoints and late joiners.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from smb_protocol.chunk_types import ChunkTypes, wire_type
from smb_protocol.dtypes import resolve
from smb_protocol.errors import InvalidArgument, RegionNotFound
from smb_protocol.hostinfo import host_id

from ..collective import AllReduce, Collective
from ..coord import Attendance, Barrier, controller_barrier
from ..cuda_round import StagedRound
from ..futures import wait_all
from .counters import SYNC_BARRIER_WORD, SharedCounters
from .flat import GradientHooks
from .launch import check_torchrun
from .layout import ALIGN, Bucket
from .steps import StepTimes
from .store import COUNTER_WORDS, SYNC_SLOTS, ParameterStore

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_PUBLISH_EVERY", "SYNC_SLOTS", "SyncDataParallel"]

DEFAULT_PUBLISH_EVERY = 1         # steps between publications of the weights
DEFAULT_BUCKET_BYTES = 256 << 10  # bytes per pushed bucket
BARRIER_TIMEOUT = 300.0           # seconds
BUFFER_MODES = ("broadcast", "average", "none")
EXCHANGES = ("auto", "collective", "slots")


COMPRESSIONS = ("bf16", "fp16", "bf16-full", "fp16-full")


def compression_types(compression: str | None, dtype: Any, exchange: str) -> tuple[str | None, bool]:
    """The wire type and full-sum choice of a ``compression`` option (see
    :class:`SyncDataParallel`); InvalidArgument or DtypeError for one that cannot
    apply to parameters of ``dtype`` exchanged by ``exchange``."""
    if compression in (None, "none"):
        return None, False
    if compression not in COMPRESSIONS:
        raise InvalidArgument(f"unknown compression {compression!r}: expected one of "
                              f"{', '.join(COMPRESSIONS)} or None")
    if exchange != "collective":
        raise InvalidArgument(f"compression={compression!r} needs the collective exchange, not {exchange!r}")
    wire, _, full = compression.partition("-")
    ChunkTypes(resolve(dtype), wire_type(wire), bool(full))   # DtypeError for parameters it cannot carry
    return wire, bool(full)


class SyncDataParallel:
    """Synchronous SGD over a :class:`ParameterStore` (with at least three gradient slots
    for ``exchange="slots"``; the collective exchange needs none).

    Use it as DDP::

        optimizer.zero_grad(); loss.backward(); optimizer.step()

    With ``overlap=True`` (the default) the backward pass ends by synchronizing the
    gradients (as DDP's does), so :meth:`synchronize` after it returns at once; with
    ``overlap=False`` call :meth:`synchronize` between backward and step. Either
    ``optimizer.zero_grad()`` or :meth:`zero_grad` resets the gradients.

    ``rank`` is this worker's index among ``world`` workers. With ``counters`` (a
    lockstep :class:`SharedCounters`) every step is published and :attr:`stop` turns
    true, on every worker after the same step, when the stopping rule fires.

    ``publish_every`` (steps; 0: only at :meth:`close`) is how often the workers write
    the current weights into the store's ``params`` region, each its ``1/world`` share.
    Use :meth:`no_sync` for all but the last micro-batch of an accumulated step.
    ``buffers`` (``broadcast``, ``average`` or ``none``) is how the model's buffers
    are kept equal across replicas, each step.
    The store stays the caller's; :meth:`close` publishes the final weights and removes
    the hooks.
    ``worker_hosts`` (collective exchange): every worker's host id, so that the
    collective's chunks go to memory servers by where the workers run
    (:meth:`~smb_client.collective.Collective.create`); None: gathered once through
    ``torch.distributed`` when it is initialized over ``world`` processes, else
    unknown (chunks dealt evenly over all servers); ``[]``: do not gather.
    ``priority`` (collective exchange): the chunks the next forward pass needs first
    (the first layers', the lowest offsets) go out first whenever several wait, as
    BytePS orders them; False: in the order the backward pass makes them final.

    ``rank`` and ``world`` must match torchrun's ``RANK`` and ``WORLD_SIZE`` (and fit
    ``LOCAL_RANK``) where those are set: InvalidArgument naming both numbers at once,
    instead of a barrier that waits for workers that do not exist. ``check_env=False``
    skips the check (only some of torchrun's workers train together).

    :attr:`times` (:class:`~smb_client.torch.steps.StepTimes`) keeps each step's seconds
    computing and waiting (pushes, sums, barrier); the waits are ``smb::sync.*`` ranges in
    a ``torch.profiler`` trace. ``log_every`` logs their means every that many steps;
    ``writer`` (a TensorBoard ``SummaryWriter``) receives them every step.

    ``compression`` (collective exchange, float32 parameters): ``"bf16"`` or ``"fp16"``
    sends the gradients as 16-bit values, half the bytes; the memory servers sum them in
    float32 and send the sum back rounded once (``"bf16-full"``/``"fp16-full"``: the
    float32 sum itself, twice the return bytes, never rounded). None: float32 both ways.
    Every worker must pass the same.
    """

    def __init__(self, store: ParameterStore, rank: int, world: int, *, overlap: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, counters: SharedCounters | None = None,
                 barrier_timeout: float = BARRIER_TIMEOUT,
                 publish_every: int = DEFAULT_PUBLISH_EVERY, buffers: str = "broadcast",
                 exchange: str = "auto", worker_hosts: Sequence[str] | None = None,
                 check_env: bool = True, priority: bool = True, log_every: int = 0,
                 writer: Any = None, compression: str | None = None) -> None:
        if not 0 <= rank < world:
            raise InvalidArgument(f"rank {rank} outside 0..{world - 1}")
        self.priority = priority
        if check_env:
            check_torchrun(rank, world, "SyncDataParallel")
        if counters is not None and not counters.lockstep:
            raise InvalidArgument("synchronous workers need SharedCounters(..., lockstep=True)")
        if publish_every < 0:
            raise InvalidArgument(f"publish_every must be >= 0 (0: only at close), got {publish_every}")
        if exchange not in EXCHANGES:
            raise InvalidArgument(f"unknown exchange {exchange!r}: expected one of {', '.join(EXCHANGES)}")
        if exchange == "collective" and store.flat.dtype is None:
            raise InvalidArgument("exchange='collective' needs parameters of one element type; this model "
                                  "mixes types: use exchange='slots'")
        if exchange == "auto":
            exchange = "collective" if store.flat.dtype is not None else "slots"
        self.wire, self.full_sum = compression_types(compression, store.flat.dtype, exchange)
        if exchange == "slots" and store.grad_slots < SYNC_SLOTS:
            raise InvalidArgument(f"exchange='slots' needs a store with grad_slots >= {SYNC_SLOTS}, "
                                  f"{store.prefix!r} has {store.grad_slots}: create it with "
                                  f"grad_slots={SYNC_SLOTS}"
                                  + (" (or use the default collective exchange, which needs none)"
                                     if store.flat.dtype is not None else ""))
        if buffers not in BUFFER_MODES:
            raise InvalidArgument(f"unknown buffers mode {buffers!r}: expected one of {', '.join(BUFFER_MODES)}")
        if buffers != "none" and store.buffer_layout is None and any(True for _ in store.flat.model.buffers()):
            raise InvalidArgument(f"parameter store {store.prefix!r} holds no buffers but the model has some: "
                                  "create it with buffers=True, or pass buffers='none'")
        self.store = store
        self.flat = store.flat
        self.rank = rank
        self.world = world
        self.overlap = overlap
        self.counters = counters
        self.barrier_timeout = barrier_timeout
        self.publish_every = publish_every
        self.buffers = buffers if store.buffer_layout is not None else "none"
        self.barrier_name = f"{store.prefix}/sync"
        self.step = 0
        self.stop = False
        self.comm_wait = 0.0   # seconds spent waiting for pushes, barrier and pull
        self.times = StepTimes("sync", log_every, writer)
        slot = store.layout.slot_bytes
        share = -(-slot // world // ALIGN) * ALIGN
        lo, hi = min(slot, rank * share), min(slot, (rank + 1) * share)
        self._runs = self.flat.runs()              # trainable byte ranges of a slot
        # this worker's share of the trainable ranges: zeroed in grads, published in params
        self._share = [(max(lo, off), min(hi, off + n) - max(lo, off)) for off, n in self._runs
                       if max(lo, off) < min(hi, off + n)]
        self._published = 0                        # steps the stored weights reflect
        self._accumulating = False
        self._closed = False
        self._synced_in_backward = False           # the last backward pass ended synchronized
        self._hooks = GradientHooks(self.flat, bucket_bytes, self._push_bucket,
                                    after_backward=self._after_backward) if overlap else None
        self.roll = self._attendance(store.region("counters"))
        self._barrier = Barrier(store.region("counters"), SYNC_BARRIER_WORD * 8, world,
                                name=f"barrier {store.prefix}/step", roll=self.roll)
        self._barrier_ready = False                # the first step zeroes the word (see _meet)
        self.exchange = exchange
        self._coll: Collective | None = None
        self._round: AllReduce | StagedRound | None = None
        if exchange == "collective":
            self._coll = self._open_collective(self._worker_hosts(worker_hosts))
            self._coll.roll = self.roll
            # held back until synchronize(): see the module's notes on aligned stopping
            self._hold = self._runs[-1][0] if self._runs else None

    @property
    def collective(self) -> Collective | None:
        """The collective exchange's :class:`~smb_client.collective.Collective` (None
        with ``exchange="slots"``); its ``timeout`` bounds each round's wait."""
        return self._coll

    def _attendance(self, region: Any) -> Attendance | None:
        """Every worker's arrivals at the step's waits, on the last ``world`` words of the
        counters region (past the per-worker counts), so a stalled step names who is
        missing; None when the region is too small (a store made for fewer workers)."""
        offset = (region.size - 8 * self.world) // 8 * 8
        if offset < (COUNTER_WORDS + self.world) * 8:
            log.info("counters region %s too small to name missing workers: create the store with "
                     "workers=%d", region.name, self.world)
            return None
        return Attendance(region, offset, self.world, self.rank)

    def _worker_hosts(self, given: Sequence[str] | None) -> list[str] | None:
        """Every worker's host id: ``given``, or gathered through torch.distributed
        (see the class); None when unknown."""
        if given is not None:
            if given and len(given) != self.world:
                raise InvalidArgument(f"worker_hosts names {len(given)} hosts for {self.world} workers")
            return list(given) or None
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world):
            return None
        hosts: list[Any] = [None] * self.world
        dist.all_gather_object(hosts, host_id())
        return [str(h) for h in hosts]

    def _open_collective(self, worker_hosts: list[str] | None) -> Collective:
        """Rank 0 makes ``<prefix>/allreduce`` afresh (its counts must start at zero),
        its chunks placed by ``worker_hosts`` when known; the others open it after a
        controller barrier (once, not per step)."""
        store = self.store
        name = store.region_name(store.prefix, "allreduce")
        coll = None
        if self.rank == 0:
            try:
                store.client.delete_region(name)
            except RegionNotFound:
                pass
            packed = max(8, sum(n for _, n in self._runs))   # only trainable bytes travel
            coll = Collective.create(store.client, name, packed, self.world, timeout=self.barrier_timeout,
                                     worker_hosts=worker_hosts, priority=self.priority, lease=store.lease)
            if self.roll is not None:   # nobody waits yet: everybody is at the barrier below
                self.roll.reset()
        controller_barrier(store.client, f"{store.prefix}/allreduce", self.world, timeout=self.barrier_timeout,
                           rank=self.rank)
        if coll is None:
            coll = Collective.open(store.client, name, self.world, timeout=self.barrier_timeout, fresh=True,
                                   priority=self.priority)
        return coll

    def _begin_round(self) -> AllReduce | StagedRound:
        if self._round is None:
            assert self._coll is not None
            self._round = self._coll.begin(self.flat.flat_grads, runs=self._runs, hold=self._hold,
                                           wire=self.wire, full_sum=self.full_sum)
        return self._round

    # -- per step -----------------------------------------------------------------
    def _slot(self, step: int) -> int:
        return step % SYNC_SLOTS

    def _push_bucket(self, bucket: Bucket) -> list[Future[Any]]:
        if self._coll is not None:   # the chunks whose gradients are all final go out
            self._begin_round().ready(bucket.offset, bucket.length)
            return []
        base = self.store.slot_offset("grads", self._slot(self.step))
        return self.store.accumulate_flat("grads", base, self.flat.flat_grads, bucket.offset, bucket.length)

    def _push_buffers(self) -> list[Future[Any]]:
        """Before the barrier: this step's buffer slot filled (see the module's notes)."""
        store = self.store
        if self.buffers == "none":
            return []
        slot = 1 + self._slot(self.step)
        region = store.region("buffers")
        out: list[Future[Any]] = []
        sent = 0
        if self.rank == 0:
            written = [(off, b.detach().contiguous()) for off, b in store.buffer_items(slot)
                       if self.buffers == "broadcast" or not b.is_floating_point()]
            if written:
                out.append(region.write_many_async(written))
                sent += sum(b.numel() * b.element_size() for _, b in written)
            if self.buffers == "average":
                nxt = store.buffer_offset(1 + self._slot(self.step + 1))
                assert store.buffer_layout is not None
                out.append(region.write_async(nxt, self._zeros(store.buffer_layout.slot_bytes)))
                sent += store.buffer_layout.slot_bytes
        if self.buffers == "average":
            summed = [(off, b.detach().contiguous()) for off, b in store.buffer_items(slot, floating_only=True)]
            if summed:
                out.append(region.accumulate_many_async(summed))
                sent += sum(b.numel() * b.element_size() for _, b in summed)
        if out:
            store.count_traffic(sent=sent)
        return out

    def _pull_buffers(self) -> None:
        """After the barrier: the synchronized buffers into the model."""
        if self.buffers == "none" or (self.buffers == "broadcast" and self.rank == 0):
            return
        self.store.pull_buffers(1 + self._slot(self.step))
        if self.buffers == "average":
            with torch.no_grad():
                for b in self.store.buffers:
                    if b.is_floating_point():
                        b.mul_(1.0 / self.world)

    def zero_grad(self) -> None:
        """Zero the local gradients (call before each step's first backward pass)."""
        self.flat.zero_grad()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally, as with DDP::

            dp.zero_grad()
            with dp.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(model(x), y).backward()
            loss_fn(model(x_last), y_last).backward()   # pushes the accumulated sum
            dp.synchronize()
        """
        if self._accumulating:
            yield
            return
        self._accumulating = True
        if self._hooks is not None:
            self._hooks.paused = True
        try:
            yield
        finally:
            self._accumulating = False
            if self._hooks is not None:
                self._hooks.paused = False

    def _publish_async(self) -> list[Future[Any]]:
        data = self.flat.flat_params
        out = [self.store.write_async("params", off, self.flat.byte_range(data, off, n))
               for off, n in self._share]
        if self.rank == 0 and self.store.buffer_layout is not None:
            items = [(off, b.detach().clone()) for off, b in self.store.buffer_items(0)]
            out.append(self.store.region("buffers").write_many_async(items))
        return out

    def publish(self) -> None:
        """Write this worker's share of the current weights into the ``params`` region
        (every worker does it in :meth:`close`; the store holds the whole model once all
        have)."""
        self._wait(self._publish_async())
        self._published = self.step

    @staticmethod
    def _wait(futures: list[Future[Any]]) -> None:
        wait_all(futures)

    def _after_backward(self) -> None:
        """The end of a backward pass outside :meth:`no_sync` (``overlap=True``): the
        step's gradients are synchronized before ``loss.backward()`` returns, as DDP's."""
        self._synchronize()
        self._synced_in_backward = True

    def synchronize(self) -> None:
        """Finish pushing this step's gradients, wait for every worker, and replace the
        local gradients by the average over all workers. With ``overlap=True`` the
        backward pass already did (outside :meth:`no_sync`), and this returns at once."""
        if self._synced_in_backward and not self._accumulating:
            self._synced_in_backward = False
            return
        self._synchronize()

    def _synchronize(self) -> None:
        self._synced_in_backward = False
        if self._accumulating:
            raise InvalidArgument("synchronize() inside no_sync(): run the last micro-batch's backward "
                                  "pass outside no_sync(), then synchronize")
        if self._closed:
            raise InvalidArgument("synchronize() after close()")
        self.flat.check_trainable()
        if self._coll is not None:
            self._synchronize_collective()
            return
        store = self.store
        nxt = self.store.slot_offset("grads", self._slot(self.step + 1))
        futures: list[Future[Any]] = []
        for off, n in self._share:
            futures.append(store.write_async("grads", nxt + off, self._zeros(n)))
        publish = bool(self.publish_every) and self.step > self._published and \
            self.step % self.publish_every == 0
        if publish:   # the weights after `step` optimizer steps; nobody changes them before we return
            futures.extend(self._publish_async())
        if self._hooks is not None:
            for pushed in self._hooks.finish():
                futures.extend(pushed)
        else:
            self.flat.collect_grads()
            base = store.slot_offset("grads", self._slot(self.step))
            for off, n in self._runs:
                futures.extend(store.accumulate_flat("grads", base, self.flat.flat_grads, off, n))
        futures.extend(self._push_buffers())
        t0 = time.perf_counter()
        times = self.times
        with times.phase("push"):
            self._wait(futures)
        if publish:
            self._published = self.step
        with times.phase("barrier"):
            if self.counters is not None:
                self.counters.publish()
            self._meet()
        with times.phase("sum"):
            base = store.slot_offset("grads", self._slot(self.step))
            for off, n in self._runs:
                store.read_into("grads", base + off, self.flat.byte_range(self.flat.flat_grads, off, n))
            self.flat.scale_(self.flat.flat_grads, 1.0 / self.world)
            self._pull_buffers()
        if self.counters is not None:
            self.stop = self.counters.should_stop()
        self.comm_wait += time.perf_counter() - t0
        self.step += 1
        times.end_step()

    def _synchronize_collective(self) -> None:
        futures: list[Future[Any]] = []
        publish = bool(self.publish_every) and self.step > self._published and \
            self.step % self.publish_every == 0
        if publish:
            futures.extend(self._publish_async())
        if self._hooks is not None:
            self._hooks.finish()           # the buckets that got no gradient go out now
        else:
            self.flat.collect_grads()
        t0 = time.perf_counter()
        times = self.times
        if self.counters is not None:      # before the held-back chunk: see the module's notes
            self.counters.publish()
        rnd = self._begin_round()
        self._round = None
        with times.phase("sum"):           # the last pushes and every chunk's sum
            try:
                if self._hooks is None:
                    for off, n in self._runs:
                        rnd.ready(off, n)
            finally:
                rnd.finish()
        self.store.count_traffic(sent=sum(n for _, n in self._runs), received=sum(n for _, n in self._runs))
        self.flat.scale_(self.flat.flat_grads, 1.0 / self.world)
        futures.extend(self._push_buffers())
        with times.phase("push"):
            self._wait(futures)
        if publish:
            self._published = self.step
        if self.buffers != "none":
            with times.phase("barrier"):
                self._meet()
            with times.phase("sum"):
                self._pull_buffers()
        if self.counters is not None:
            self.stop = self.counters.should_stop()
        self.comm_wait += time.perf_counter() - t0
        self.step += 1
        times.end_step()

    def _meet(self) -> None:
        """Wait for every worker. The first step meets at the controller's barrier, after
        rank 0 zeroed the memory box's barrier word; every later step meets on that word
        (:class:`~smb_client.coord.Barrier`), so steady-state steps call no controller."""
        if self._barrier_ready:
            self._barrier.wait(timeout=self.barrier_timeout)
            return
        if self.rank == 0:
            self.store.region("counters").write(SYNC_BARRIER_WORD * 8, bytes(8))
            if self.roll is not None and self._coll is None:   # the collective's rounds count already
                self.roll.reset()
        controller_barrier(self.store.client, self.barrier_name, self.world, timeout=self.barrier_timeout,
                           rank=self.rank)
        self._barrier_ready = True

    _zero_cache: memoryview | None = None

    def _zeros(self, nbytes: int) -> memoryview:
        if self._zero_cache is None or len(self._zero_cache) < nbytes:
            self._zero_cache = memoryview(bytes(nbytes))
        return self._zero_cache[:nbytes]

    def close(self, publish: bool = True) -> None:
        """Publish the final weights (unless ``publish`` is False or they already are)
        and remove the hooks. Call it after the last optimizer step; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if publish and self.step != self._published:
                self.publish()
        finally:
            if self._hooks is not None:
                self._hooks.remove()
                self._hooks = None
            self._round = None                # a backward pass without synchronize() is dropped
            if self._coll is not None:
                self._coll.close()

    def __enter__(self) -> SyncDataParallel:
        """The trainer itself."""
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """:meth:`close`, publishing unless an exception ends the block."""
        self.close(publish=exc_type is None)
