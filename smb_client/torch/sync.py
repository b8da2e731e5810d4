"""Synchronous data parallelism through the memory box.

Every step each worker accumulates its gradients into a gradient slot of the store
(server-side ``+=``), all meet at a controller barrier, then each reads the summed
gradients back, divides by the number of workers and runs its own (identical)
optimizer step. All replicas stay equal to a single process training on the union of
the workers' batches.

Resetting the accumulation slot. The store has three gradient slots used in turn:
step ``s`` accumulates into slot ``s % 3``. Between the barriers of steps ``s-1`` and
``s`` every worker zeroes its share of slot ``(s+1) % 3``. That slot was last read in
step ``s-2``, which every worker finished before it pushed in step ``s-1`` (and so
before barrier ``s-1`` opened); nobody accumulates into it before step ``s+1``, which
starts only after barrier ``s`` opened, which needs every worker's zeroing done. One
barrier per step, and the zeroing is spread over all workers.

With ``overlap=True`` gradients are pushed bucket by bucket from backward hooks as
asynchronous operations, so the communication of the last layers overlaps the backward
pass of the first ones.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from ..errors import InvalidArgument
from .counters import SharedCounters
from .flat import GradientHooks
from .layout import ALIGN, Bucket
from .store import ParameterStore

log = logging.getLogger(__name__)

SYNC_SLOTS = 3                    # gradient slots the rotation needs
DEFAULT_BUCKET_BYTES = 256 << 10  # bytes per pushed bucket
BARRIER_TIMEOUT = 300.0           # seconds


class SyncDataParallel:
    """Synchronous SGD over a :class:`ParameterStore` with at least three gradient slots.

    Use::

        dp.zero_grad(); loss.backward(); dp.synchronize(); optimizer.step()

    ``rank`` is this worker's index among ``world`` workers. With ``counters`` (a
    lockstep :class:`SharedCounters`) every step is published and :attr:`stop` turns
    true, on every worker after the same step, when the stopping rule fires.
    The store stays the caller's; :meth:`close` removes the hooks.
    """

    def __init__(self, store: ParameterStore, rank: int, world: int, *, overlap: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, counters: SharedCounters | None = None,
                 barrier_timeout: float = BARRIER_TIMEOUT) -> None:
        if store.grad_slots < SYNC_SLOTS:
            raise InvalidArgument(f"synchronous training needs a store with grad_slots >= {SYNC_SLOTS}, "
                                  f"{store.prefix!r} has {store.grad_slots}")
        if not 0 <= rank < world:
            raise InvalidArgument(f"rank {rank} outside 0..{world - 1}")
        if counters is not None and not counters.lockstep:
            raise InvalidArgument("synchronous workers need SharedCounters(..., lockstep=True)")
        self.store = store
        self.flat = store.flat
        self.rank = rank
        self.world = world
        self.overlap = overlap
        self.counters = counters
        self.barrier_timeout = barrier_timeout
        self.barrier_name = f"{store.prefix}/sync"
        self.step = 0
        self.stop = False
        self.comm_wait = 0.0   # seconds spent waiting for pushes, barrier and pull
        slot = store.layout.slot_bytes
        share = -(-slot // world // ALIGN) * ALIGN
        self._zero_range = (min(slot, rank * share), min(slot, (rank + 1) * share))
        self._hooks = GradientHooks(self.flat, bucket_bytes, self._push_bucket) if overlap else None

    # -- per step -----------------------------------------------------------------
    def _slot(self, step: int) -> int:
        return step % SYNC_SLOTS

    def _push_bucket(self, bucket: Bucket) -> Future:
        base = self.store.slot_offset("grads", self._slot(self.step))
        data = self.flat.byte_range(self.flat.flat_grads, bucket.offset, bucket.length)
        return self.store.accumulate_async("grads", base + bucket.offset, data)

    def zero_grad(self) -> None:
        """Zero the local gradients (call before each backward pass)."""
        self.flat.zero_grad()

    def synchronize(self) -> None:
        """Finish pushing this step's gradients, wait for every worker, and replace the
        local gradients by the average over all workers."""
        store = self.store
        nxt = self.store.slot_offset("grads", self._slot(self.step + 1))
        lo, hi = self._zero_range
        futures: list[Future] = []
        if hi > lo:
            futures.append(store.write_async("grads", nxt + lo,
                                             self._zeros(hi - lo)))
        if self._hooks is not None:
            futures.extend(self._hooks.finish())
        else:
            self.flat.collect_grads()
            futures.append(store.accumulate_async("grads", store.slot_offset("grads", self._slot(self.step)),
                                                  self.flat.flat_grads))
        t0 = time.perf_counter()
        error: BaseException | None = None
        for f in futures:
            try:
                f.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        if self.counters is not None:
            self.counters.publish()
        store.client.barrier(self.barrier_name, self.world, timeout=self.barrier_timeout)
        store.read_into("grads", store.slot_offset("grads", self._slot(self.step)), self.flat.flat_grads)
        self.flat.flat_grads.mul_(1.0 / self.world)
        if self.counters is not None:
            self.stop = self.counters.should_stop()
        self.comm_wait += time.perf_counter() - t0
        self.step += 1

    _zero_cache: Any = None

    def _zeros(self, nbytes: int) -> memoryview:
        if self._zero_cache is None or len(self._zero_cache) < nbytes:
            self._zero_cache = memoryview(bytes(nbytes))
        return self._zero_cache[:nbytes]

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def __enter__(self) -> "SyncDataParallel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
