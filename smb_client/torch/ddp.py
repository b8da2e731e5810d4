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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .job import LEASE, Job
from .sync import SyncDataParallel

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
    ``module`` (see the module). ``options`` go to :class:`SyncDataParallel`
    (``bucket_bytes``, ``buffers``, ``exchange``, ...); ``name``, ``lease`` and
    ``job_options`` (``placement``, ``client``, ``env``, ...) to the :class:`Job`. The
    module stays the caller's; :meth:`close` ends the job."""

    def __init__(self, module: torch.nn.Module, *, name: str | None = None, lease: float | None = LEASE,
                 job_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        self.module = module
        self.job = Job(name or default_name(), module, lease=lease, **(job_options or {})).start()
        try:
            self.dp: SyncDataParallel = self.job.sync(**options)
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
