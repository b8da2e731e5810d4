"""``SyncDataParallel`` in the shape of ``torch.nn.parallel.DistributedDataParallel``.

    ddp = smb_client.torch.DistributedDataParallel(model)    # was: torch.nn.parallel.Distr...
    ...                                                      # the DDP loop, unchanged

One call starts a :class:`~smb_client.torch.job.Job` (the store, created by rank 0 and
attached by the others, whose regions go with the job's lease) and a
:class:`~smb_client.torch.sync.SyncDataParallel` over it, and returns a module that runs
the wrapped one: ``ddp(x)``, ``ddp.parameters()``, ``ddp.no_sync()`` and ``ddp.module``
work as with DDP. :meth:`DistributedDataParallel.close` publishes the final weights,
waits for every worker and deletes the job's regions; a program that ends normally
without calling it does so at exit (``atexit``). One that ends by an uncaught exception,
or is killed (torchrun stops the others with SIGTERM when one fails), leaves them to
the job's lease, which deletes them :data:`~smb_client.torch.job.LEASE` seconds after
the last worker is gone.

After ``torchrun --max-restarts`` started the group again, the wrapper **starts
afresh**: rank 0 replaces the dead attempt's store, and every worker begins from rank
0's model as in the first attempt, as a DDP loop begins again at its first epoch with a
new optimizer (``ddp.job.resumed`` is None). To go on from where a run stopped, give
the job a checkpoint (``job_options={"checkpoint": path, "optimizer": opt}``, saved
with ``ddp.job.save(step=...)``): the weights, the optimizer's state and
``ddp.job.step`` then come from the file (``ddp.job.resumed == "checkpoint"``).
``job_options={"resume": True}`` goes on from the store's weights instead (the
:func:`~smb_client.torch.job.job` default; the loop must then know its own step).

The job's name (``name=``; default :func:`default_name`) must be the same in every
worker: under torchrun it is derived from ``TORCHELASTIC_RUN_ID`` (so a restarted group
finds its store), else rank 0 draws one and shares it through ``torch.distributed``.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from smb_protocol.errors import InvalidArgument

from .counters import SharedCounters
from .job import LEASE, Job
from .sync import BARRIER_TIMEOUT, DEFAULT_BUCKET_BYTES, DEFAULT_PUBLISH_EVERY, SyncDataParallel

log = logging.getLogger(__name__)

__all__ = ["DistributedDataParallel", "default_name"]

_crashed = threading.Event()     # an uncaught exception ended the main thread
_hooked = False


def _watch_for_crash() -> None:
    """Chain ``sys.excepthook`` once, so that the exit handler can tell a crash."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(*info: Any) -> None:
        _crashed.set()
        previous(*info)
    sys.excepthook = hook


def default_name() -> str:
    """The job name every worker of this launch agrees on: ``ddp/<run id>`` under
    torchrun (``ddp/<run id>-<MASTER_PORT>`` for the run id ``none``), else drawn by
    rank 0 and broadcast through ``torch.distributed`` when it is initialized, else new."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"ddp/{run}"
    if run:
        return f"ddp/{run}-{os.environ.get('MASTER_PORT', '0')}"
    drawn = [f"ddp/{uuid.uuid4().hex[:16]}"]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(drawn, src=0)
    return str(drawn[0])


class DistributedDataParallel(torch.nn.Module):
    """Synchronous data parallelism through the memory box where DDP would wrap
    ``module`` (see the module). The module stays the caller's; :meth:`close` ends the job.

    DDP's arguments, in DDP's order, so that a DDP call moves over unchanged:

    * ``broadcast_buffers``: True (or None, DDP's default) gives every replica rank 0's
      buffers each step (``buffers="broadcast"``), False leaves each its own
      (``buffers="none"``); ``buffers=`` below says the same, one of them at a time.
    * ``bucket_cap_mb``: the size of the pushed buckets, in MiB (``bucket_bytes``).
    * ``process_group``: the workers are torchrun's; a group of another size raises
      InvalidArgument (the memory box, not the group, carries the gradients).
    * ``mixed_precision``: not supported (InvalidArgument): gradients are summed in the
      parameters' own types.
    * Accepted and without effect here: ``device_ids``, ``output_device`` and ``dim``
      (one replica per process, on the CPU); ``init_sync`` (every worker always starts
      from the store's weights, rank 0's); ``find_unused_parameters`` and
      ``static_graph`` (a parameter without a gradient is found anyway: its bucket is
      pushed at the end of the backward pass); ``check_reduction``;
      ``gradient_as_bucket_view`` (the gradients always are views of one flat buffer);
      ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
      ``skip_all_reduce_unused_params``, ``bucket_cap_mb_list``, ``batched_grad_copy``,
      ``forward_sync_buffers`` and ``device_mesh``.

    Then the wrapper's own, keyword only: ``name`` (default :func:`default_name`),
    ``lease`` and ``job_options`` (a dict of :class:`Job`'s options: ``client``,
    ``env``, ``placement``, ``grad_slots``, ...) make the job; ``overlap`` through
    ``compression`` are :class:`SyncDataParallel`'s (``compression="bf16"``: gradients
    travel as 16-bit values and are summed in float32 by the memory servers).
    """

    def __init__(self, module: torch.nn.Module, device_ids: Sequence[Any] | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool | None = None,
                 init_sync: bool = True, process_group: Any = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list: list[int] | None = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None, *,
                 name: str | None = None, lease: float | None = LEASE, job_options: dict[str, Any] | None = None,
                 overlap: bool = True, bucket_bytes: int | None = None, counters: SharedCounters | None = None,
                 barrier_timeout: float = BARRIER_TIMEOUT, publish_every: int = DEFAULT_PUBLISH_EVERY,
                 buffers: str | None = None, exchange: str = "auto", worker_hosts: Sequence[str] | None = None,
                 check_env: bool = True, priority: bool = True, log_every: int = 0,
                 writer: Any = None, compression: str | None = None) -> None:
        super().__init__()
        if mixed_precision is not None:
            raise InvalidArgument("mixed_precision is not supported here: gradients are summed in the "
                                  "parameters' own types (keep float32 parameters for float32 sums)")
        if broadcast_buffers is not None and buffers is not None:
            raise InvalidArgument("give broadcast_buffers= (DDP's) or buffers= (SyncDataParallel's), not both")
        if bucket_cap_mb is not None and bucket_bytes is not None:
            raise InvalidArgument("give bucket_cap_mb= (DDP's, MiB) or bucket_bytes=, not both")
        if buffers is None:
            buffers = "none" if broadcast_buffers is False else "broadcast"
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_cap_mb is None else max(1, int(bucket_cap_mb * (1 << 20)))
        self.module = module
        # a restarted group starts afresh, as a DDP loop does (its epoch 0, a new optimizer)
        options: dict[str, Any] = {"resume": False, **(job_options or {})}
        self.job = Job(name or default_name(), module, lease=lease, **options)
        if process_group is not None:
            size = torch.distributed.get_world_size(process_group)
            if size != self.job.world:
                raise InvalidArgument(f"process_group has {size} ranks, but the job trains with torchrun's "
                                      f"WORLD_SIZE={self.job.world} workers: leave process_group out")
        self.job.start()
        try:
            self.dp: SyncDataParallel = self.job.sync(
                overlap=overlap, bucket_bytes=bucket_bytes, counters=counters, barrier_timeout=barrier_timeout,
                publish_every=publish_every, buffers=buffers, exchange=exchange, worker_hosts=worker_hosts,
                check_env=check_env, priority=priority, log_every=log_every, writer=writer,
                compression=compression)
        except BaseException:
            self.job.abandon()
            raise
        _watch_for_crash()
        atexit.register(self._at_exit)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward pass."""
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate locally (:meth:`SyncDataParallel.no_sync`)."""
        with self.dp.no_sync():
            yield

    def close(self) -> None:
        """Publish the final weights, wait for every worker, delete the job's regions
        (:meth:`Job.finish`); idempotent."""
        atexit.unregister(self._at_exit)
        self.job.finish()

    def _at_exit(self) -> None:
        """At the interpreter's exit: :meth:`close`, or, after a crash, leave the
        regions to the lease."""
        try:
            if _crashed.is_set():
                self.job.abandon()
            else:
                self.job.finish()
        except Exception as exc:   # too late to raise: say it
            log.error("job %s: ending at exit failed: %r", self.job.name, exc)

    def __enter__(self) -> DistributedDataParallel:
        """The wrapper itself."""
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """:meth:`close` after a normal exit; after an exception the regions are left
        to the lease (:meth:`Job.abandon`)."""
        atexit.unregister(self._at_exit)
        self.job.__exit__(exc_type, *exc)
