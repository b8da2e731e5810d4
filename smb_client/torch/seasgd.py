"""Asynchronous shared-memory elastic averaging SGD (SEASGD, as in ShmCaffe).

The ``params`` region of the store holds the *global* weights; every worker owns one
*delta* slot. A worker trains on its own with any local optimizer; every
``update_interval`` steps it

1. reads the global weights ``W̃`` (before its next step),
2. computes ``Δ = α (W − W̃)`` with the moving rate ``α``,
3. subtracts it locally, ``W ← W − Δ``,
4. hands ``Δ`` to a background thread that writes it into its private delta slot and
   has the memory servers accumulate it into the global weights, ``W̃ ← W̃ + Δ``,
   while the worker already computes its next steps.

Workers never wait for each other. The elastic force pulls the workers towards the
global weights and the global weights towards the workers.

Buffers (batch-norm statistics) are not trained, so they take no part in the elastic
average: each replica keeps its own, and rank 0 publishes its buffers into the store's
published buffer slot with every update and in :meth:`SEASGD.finish`, so that
``store.load_into`` and ``store.save`` give the global weights with statistics that
fit them (not the initial ones).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from smb_protocol.errors import InvalidArgument

from .steps import StepTimes
from .store import ParameterStore

log = logging.getLogger(__name__)

DEFAULT_BETA = 0.9   # moving rate × workers, as suggested by EASGD


class SEASGD:
    """One worker of asynchronous elastic averaging. ``rank`` selects the delta slot
    (``0 <= rank < store.delta_slots``); ``moving_rate`` defaults to 0.9 / ``world``.

    Call :meth:`after_step` after every local optimizer step. :meth:`close` waits for
    the last push and stops the background thread; the store stays the caller's.

    ``publish_buffers`` (default True): rank 0 writes its model's buffers into the
    store (see the module's notes) when the store holds buffers.

    :attr:`times` keeps each local step's seconds computing and waiting (``push``: for
    the previous delta to land; ``sum``: reading the global weights), ``smb::seasgd.*``
    ranges in a ``torch.profiler`` trace; ``log_every`` and ``writer`` as for
    :class:`~smb_client.torch.SyncDataParallel`.
    """

    def __init__(self, store: ParameterStore, rank: int, world: int, *, moving_rate: float | None = None,
                 update_interval: int = 4, keep_deltas: bool = True, publish_buffers: bool = True,
                 log_every: int = 0, writer: Any = None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise InvalidArgument(f"rank {rank} outside 0..{world - 1}")
        if update_interval < 1:
            raise InvalidArgument(f"update_interval must be >= 1, got {update_interval}")
        alpha = DEFAULT_BETA / world if moving_rate is None else float(moving_rate)
        if not 0.0 < alpha <= 1.0:
            raise InvalidArgument(f"moving_rate must lie in (0, 1], got {alpha}")
        if keep_deltas and store.delta_slots <= rank:
            raise InvalidArgument(f"SEASGD keeps a private delta slot per worker: store {store.prefix!r} has "
                                  f"{store.delta_slots} delta slots, rank {rank} needs {rank + 1} "
                                  "(create it with scheme=\"seasgd\", workers=<world>, under job() with "
                                  "job(..., scheme=\"seasgd\"); or pass keep_deltas=False)")
        self.store = store
        self.flat = store.flat
        self.rank = rank
        self.world = world
        self.moving_rate = alpha
        self.update_interval = update_interval
        self.keep_deltas = keep_deltas
        self.publish_buffers = publish_buffers and rank == 0 and store.buffer_layout is not None
        self._buffers: list[tuple[int, torch.Tensor]] = []   # rank 0's, as of the last update
        self.global_weights = store.flat.new_flat()   # last global weights read
        self.delta = store.flat.new_flat()            # last delta pushed
        self.step = 0
        self.updates = 0
        self.read_wait = 0.0   # seconds spent reading the global weights
        self.push_wait = 0.0   # seconds spent waiting for a previous push to finish
        self.times = StepTimes("seasgd", log_every, writer)   # per local step: see steps.py
        self._pusher = ThreadPoolExecutor(1, thread_name_prefix="smb-seasgd")
        self._pending: Future[Any] | None = None

    def after_step(self) -> bool:
        """Count one local step; run an elastic update when one is due (True then)."""
        self.step += 1
        if self.step % self.update_interval:
            self.times.end_step()
            return False
        self.update()
        self.times.end_step()
        return True

    def update(self) -> None:
        """Read the global weights, move towards them, push the delta in the background."""
        t0 = time.perf_counter()
        with self.times.phase("push"):
            self._wait_push()            # the delta buffer is about to be reused
        t1 = time.perf_counter()
        with self.times.phase("sum"):    # the global weights: every worker's deltas summed
            self.store.pull_params(self.global_weights)
        t2 = time.perf_counter()
        self.push_wait += t1 - t0
        self.read_wait += t2 - t1
        with torch.no_grad():
            if self.flat.dtype is not None:
                self._elastic(self.flat.flat_params, self.global_weights, self.delta)
            else:   # mixed element types: tensor by tensor, each in its own type
                n = self.store.layout.slot_bytes
                for (_, w), (_, g), (_, d) in zip(self.flat.typed(self.flat.flat_params, 0, n),
                                                  self.flat.typed(self.global_weights, 0, n),
                                                  self.flat.typed(self.delta, 0, n), strict=True):
                    self._elastic(w, g, d)
        if self.publish_buffers:   # a copy: the next forward passes change them meanwhile
            self._buffers = [(off, b.detach().clone()) for off, b in self.store.buffer_items(0)]
        self._pending = self._pusher.submit(self._push)
        self.updates += 1

    def _elastic(self, w: torch.Tensor, g: torch.Tensor, d: torch.Tensor) -> None:
        torch.sub(w, g, out=d)
        d.mul_(self.moving_rate)
        w.sub_(d)

    def _push(self) -> None:
        if self.keep_deltas:
            self.store.write("deltas", self.store.slot_offset("deltas", self.rank), self.delta)
        for fut in self.store.accumulate_flat("params", 0, self.delta):
            fut.result()
        if self._buffers:
            items, self._buffers = self._buffers, []
            self.store.region("buffers").write_many(items)
            self.store.count_traffic(sent=sum(b.numel() * b.element_size() for _, b in items))

    def _wait_push(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def finish(self) -> None:
        """Wait until the last delta has reached the global weights; rank 0 then
        publishes its current buffers."""
        t0 = time.perf_counter()
        self._wait_push()
        if self.publish_buffers:
            self.store.push_buffers(0)
        self.push_wait += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the last push and stop the background thread; idempotent."""
        try:
            self.finish()
        finally:
            self._pusher.shutdown(wait=True)

    def __enter__(self) -> SEASGD:
        """The worker itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close`."""
        self.close()
