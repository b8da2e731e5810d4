"""How the ``smb`` process group runs its operations: :class:`OperationWorker` (the one
thread that runs them in order, and the group's failure state), what each hands back
(:class:`SMBWork`, torch's ``Work``, and :class:`OrderedFuture`, whose callbacks run on
that thread in the order of the caller's operations) and :class:`StoreRoll` (who came to
the group's waits, in its c10d store)."""
from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch._C._distributed_c10d import Store, Work

from smb_protocol.errors import Closed, Timeout

from ..cuda_region import on_caller_stream
from .supported import refused

log = logging.getLogger(__name__)

__all__ = ["OperationWorker", "OrderedFuture", "SMBWork", "StoreRoll"]


class OperationWorker:
    """The worker thread of process group ``name`` (its prefix, for logs and errors):
    runs the group's operations and their futures' callbacks in order, one at a time.
    After a failed operation it refuses the next ones (:func:`.supported.refused`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="smb-pg")
        self._running = threading.local()   # .active: this thread runs an operation (or its callbacks)
        self.failed: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any], what: str, tensors: Sequence[torch.Tensor] = ()) -> SMBWork:
        """Run ``fn`` on the worker thread; ``tensors``: the operation's tensors. With CUDA
        ones, the worker runs on the caller's current stream (staging starts after the
        caller's queued work) and the future is a CUDA one (its waiters' streams wait for
        the copies back)."""
        devices: list[int | str | torch.device] = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        future = OrderedFuture(self, devices)
        fn = on_caller_stream(fn, list(tensors))

        def run() -> None:
            try:
                if self.failed is not None:
                    raise refused(self.failed)
                result = fn()
            except BaseException as exc:  # every error goes to wait()
                if self.failed is None:
                    self.failed = exc
                    log.error("smb process group %s: operation failed: %r", self.name, exc)
                future.set_exception(exc)
            else:
                future.set_result(result)
        self.enqueue(run)
        return SMBWork(future, what)

    def enqueue(self, job: Callable[[], None]) -> None:
        """Queue ``job`` on the worker thread; from the worker thread itself (a chained
        callback starting an operation) run it now."""
        with self._lock:
            if self._closed:
                raise Closed(f"process group {self.name} is shut down (destroy_process_group was called)")
            if not self.on_worker():
                self._pool.submit(self._run_job, job)
                return
        job()

    def on_worker(self) -> bool:
        """Whether the calling thread is the worker running an operation or callback."""
        return bool(getattr(self._running, "active", False))

    def _run_job(self, job: Callable[[], None]) -> None:
        self._running.active = True
        try:
            job()
        finally:
            self._running.active = False

    def close(self) -> bool:
        """Take no more operations and wait for the queued ones to end; False when it was
        closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._pool.shutdown(wait=True)
        return True


class StoreRoll:
    """Who came to a process group's waits, in its c10d ``store``: each rank counts its
    all-reduce rounds (:meth:`arrive`) and adds them to ``<keys>/at/<rank>`` only when a
    wait of its own stalls (:meth:`missing`), so steady steps cost no store call. A rank
    whose key is below this one's count has not come as far (or is not waiting)."""

    def __init__(self, store: Store, rank: int, size: int, keys: str = "smb") -> None:
        self._store = store
        self._keys = keys
        self.rank = rank
        self.size = size
        self.count = 0
        self._said = 0

    def arrive(self) -> None:
        """Count one more round of this rank."""
        self.count += 1

    def missing(self) -> list[int] | None:
        """Say how far this rank came; the ranks whose word is below it (None when the
        store cannot be reached)."""
        try:
            if self._said < self.count:
                self._store.add(f"{self._keys}/at/{self.rank}", self.count - self._said)
                self._said = self.count
            return [r for r in range(self.size) if self._store.add(f"{self._keys}/at/{r}", 0) < self.count]
        except RuntimeError as exc:
            log.info("smb process group: the c10d store cannot say who is missing: %r", exc)
            return None


class OrderedFuture(torch.futures.Future[Any]):
    """The future of an operation of ``worker``: :meth:`then` queues its callback on the
    worker thread, in the order of the caller's operations (:mod:`smb_client.torch.backend`)."""

    def __init__(self, worker: OperationWorker, devices: list[int | str | torch.device] | None = None) -> None:
        if devices:
            super().__init__(devices=devices)
        else:
            super().__init__()
        self._worker = worker
        self._devices = devices

    def then(self, callback: Callable[[Any], Any]) -> OrderedFuture:
        """A future of ``callback(self)``, run on the worker thread once this one
        ended, after the operations queued before this call."""
        child = OrderedFuture(self._worker, self._devices)

        def run() -> None:
            try:
                child.set_result(callback(self))
            except BaseException as exc:   # the chained future carries it, as torch's do
                child.set_exception(exc)
        if not self.done() and self._worker.on_worker():
            # chained by a callback on an operation queued behind it: run when that ends
            super().then(lambda _: run())
        else:
            self._worker.enqueue(run)   # behind this future's operation: it has ended by then
        return child


class SMBWork(Work):
    """One operation of an :class:`~smb_client.torch.backend.SMBProcessGroup`: done when
    its future is."""

    def __init__(self, future: torch.futures.Future[Any], what: str = "operation") -> None:
        super().__init__()
        self.future = future
        self.what = what

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Block until the operation finished (``timeout`` 0: bounded only by the
        collectives' own timeout) and raise its error; :class:`~smb_protocol.errors.Timeout`
        once a positive ``timeout`` passed first (the operation goes on)."""
        seconds = timeout.total_seconds()
        if seconds > 0 and not self.future.done():
            ended = threading.Event()
            self.future.add_done_callback(lambda _: ended.set())
            if not ended.wait(seconds):
                raise Timeout(f"smb process group: {self.what} not finished within {seconds:g} s "
                              "(it goes on; wait again, or destroy the group)")
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self.future.done()

    def get_future(self) -> torch.futures.Future[Any]:
        """The future of the operation's output tensors."""
        return self.future
