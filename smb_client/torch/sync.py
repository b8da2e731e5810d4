"""Synchronous data parallelism through the memory box.

Every step each worker accumulates its gradients into a gradient slot of the store
(server-side ``+=``), all meet at a barrier, then each reads the summed
gradients back, divides by the number of workers and runs its own (identical)
optimizer step. All replicas stay equal to a single process training on the union of
the workers' batches.

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
(:class:`~smb_client.collective.Collective`): each chunk is pushed as soon as its
gradients are final (from the backward hooks); no gradient slot, no zeroing, and no
barrier per step unless buffers are synchronized. ``exchange="slots"`` keeps the
accumulate, barrier and read of three gradient slots used in turn (needed for mixed
element types). :mod:`.exchanges` holds both, with why each keeps the steps apart.

Buffers (batch-norm statistics) are synchronized every step through the store's
``buffers`` region, slot ``1 + s % 3`` in step ``s`` (the slots' rotation argument
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

from smb_protocol.chunk_types import ChunkTypes, wire_type
from smb_protocol.dtypes import resolve
from smb_protocol.errors import InvalidArgument

from ..collective import Collective
from ..coord import Attendance
from ..futures import wait_all
from .counters import SharedCounters
from .exchanges import (
    BufferSync,
    CollectiveExchange,
    Exchange,
    SlotsExchange,
    StepBarrier,
    StepEnd,
    StepParts,
    Zeros,
    gather_worker_hosts,
)
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
        zeros = Zeros()
        self._hooks = GradientHooks(self.flat, bucket_bytes, self._push_bucket,
                                    after_backward=self._after_backward) if overlap else None
        self.roll = self._attendance(store.region("counters"))
        # the slots reset the attendance roll at the first barrier; the collective's rounds count it already
        meeting = StepBarrier(store, rank, world, self.barrier_name, timeout=lambda: self.barrier_timeout,
                              roll=self.roll, reset_roll=exchange == "slots")
        parts = StepParts(counters, self.times, BufferSync(store, rank, world, self.buffers, zeros), meeting)
        self.exchange = exchange
        self._coll: Collective | None = None
        self._exchange: Exchange
        if exchange == "collective":
            hosts = gather_worker_hosts(worker_hosts, world)
            self._coll = CollectiveExchange.open(store, rank, world, self._runs, roll=self.roll, priority=priority,
                                                 timeout=barrier_timeout, hosts=hosts)
            self._exchange = CollectiveExchange(self._coll, store, world, self._runs, parts, wire=self.wire,
                                                full_sum=self.full_sum)
        else:
            self._exchange = SlotsExchange(store, world, self._runs, self._share, zeros, parts)

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

    # -- per step -----------------------------------------------------------------
    def _push_bucket(self, bucket: Bucket) -> list[Future[Any]]:
        return self._exchange.bucket_ready(self.step, bucket.offset, bucket.length)

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
        end = StepEnd(self.step, self._exchange.begin_step(self.step), hooked=self._hooks is not None)
        publish = bool(self.publish_every) and self.step > self._published and \
            self.step % self.publish_every == 0
        if publish:   # the weights after `step` optimizer steps; nobody changes them before we return
            end.pending.extend(self._publish_async())
        if self._hooks is not None:
            for pushed in self._hooks.finish():   # the buckets that got no gradient go out now
                end.pending.extend(pushed)
        else:
            self.flat.collect_grads()
        try:
            self._exchange.finish_step(end)
        finally:
            if publish and end.sent:
                self._published = self.step
        if self.counters is not None:
            self.stop = self.counters.should_stop()
        self.comm_wait += time.perf_counter() - end.started
        self.step += 1
        self.times.end_step()

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
            self._exchange.close()            # a backward pass without synchronize() is dropped

    def __enter__(self) -> SyncDataParallel:
        """The trainer itself."""
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """:meth:`close`, publishing unless an exception ends the block."""
        self.close(publish=exc_type is None)
