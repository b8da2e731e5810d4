"""The batched forms of a region's operations (``write_many``, ``read_many``,
``fetch_add_many``, ``accumulate_many``): many ``(offset, data)`` pairs planned into
requests at once and run against every server in parallel, and the per-request
operations a region's tasks send (:data:`BufferOp`)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from smb_protocol.dtypes import DType, itemsize

from . import cuda, cuda_region
from .buffers import as_view
from .metrics import timed_method
from .transports import Session

if TYPE_CHECKING:
    from smb_protocol.placement import Layout

    from .route import Route

__all__ = ["BatchedForms", "BufferOp"]

#: one request of a task: ``op(session, ticket, extent_id, extent_offset, buffers, seq)``
BufferOp = Callable[[Session, str, int, int, list[memoryview], int], Any]


class BatchedForms:
    """The batched operations of :class:`Region <smb_client.region.Region>` (a base
    class of it)."""

    route: Route

    if TYPE_CHECKING:   # Region's layout and planning, which these use
        @property
        def layout(self) -> Layout: ...
        def _tasks(self, offset: int, view: memoryview, align: int, op: BufferOp,
                   numbered: bool = True) -> list[Callable[[], Any]]: ...
        def _typed(self, offset: int, data: Any, dtype: Any) -> tuple[memoryview, DType]: ...

    # -- batched forms -------------------------------------------------------------
    def _many(self, items: Iterable[tuple[int, Any]], fn: Callable[[int, Any], list[Callable[[], Any]]]) -> None:
        tasks: list[Callable[[], Any]] = []
        for offset, data in items:
            tasks.extend(fn(offset, data))
        if tasks:
            self.route.run_all(tasks)

    @timed_method("write")
    def write_many(self, items: Iterable[tuple[int, Any]]) -> None:
        """Write several ``(offset, data)`` pairs, all servers in parallel."""
        items = list(items)
        if any(cuda.is_cuda(data) for _, data in items):
            return cuda_region.write_many(self, items)
        self.route.check_writable()

        def plan(offset: int, data: Any) -> list[Callable[[], Any]]:
            view, _ = as_view(data)
            self.layout.check_range(offset, len(view))
            return self._tasks(offset, view, 1, _write)
        self._many(items, plan)

    @timed_method("read")
    def read_many(self, items: Iterable[tuple[int, Any]]) -> list[Any]:
        """Fill several ``(offset, out)`` buffers, all servers in parallel; returns the
        buffers, in order (as :meth:`read_into` returns its buffer)."""
        items = list(items)
        if any(cuda.is_cuda(out) for _, out in items):
            return cuda_region.read_many(self, items)
        outs: list[Any] = []

        def plan(offset: int, out: Any) -> list[Callable[[], Any]]:
            view, _ = as_view(out, writable=True)
            self.layout.check_range(offset, len(view))
            outs.append(out)
            return self._tasks(offset, view, 1, _read, numbered=False)
        self._many(items, plan)
        return outs

    @timed_method("fetch_add")
    def fetch_add_many(self, items: Iterable[tuple[int, int]]) -> list[int]:
        """``fetch_add`` of each ``(offset, value)``; returns the old values in order.

        Words of one extent go to its server as one batch (over rdma: pipelined atomics
        on one queue pair, one round trip's wait for the lot); servers run in parallel.
        Every word is checked (alignment, bounds) before any is touched. Each add is
        atomic; the batch is not (another client's atomics may interleave).
        """
        route = self.route
        route.check_writable()
        batches: dict[int, tuple[int, list[int], list[tuple[int, int]]]] = {}
        n = 0
        for offset, value in items:
            slot, eoff = route.word(offset)
            _, where, ops = batches.setdefault(slot, (slot, [], []))
            where.append(n)
            ops.append((eoff, int(value)))
            n += 1
        olds = [0] * n

        def batch(slot: int, where: list[int], ops: list[tuple[int, int]]) -> Callable[[], None]:
            seq = route.next_seq()      # word k of the batch: seq + k

            def run() -> None:
                got = route.request(slot, True, lambda s, place: s.fetch_add_many(
                    route.ticket, place.extent_id, ops, seq))
                for k, old in zip(where, got, strict=True):
                    olds[k] = old
            return run
        tasks = [batch(*b) for b in batches.values()]
        if tasks:
            self.route.run_all(tasks)
        return olds

    @timed_method("accumulate")
    def accumulate_many(self, items: Iterable[tuple[int, Any]], dtype: Any = None) -> None:
        """Accumulate several ``(offset, data)`` pairs, all servers in parallel."""
        items = list(items)
        if any(cuda.is_cuda(data) for _, data in items):
            return cuda_region.write_many(self, items, accumulate_as=dtype)
        self.route.check_writable()

        def plan(offset: int, data: Any) -> list[Callable[[], Any]]:
            view, dt = self._typed(offset, data, dtype)
            return self._tasks(offset, view, itemsize(dt), _accumulate(dt))
        self._many(items, plan)

def _write(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
    s.write(ticket, extent_id, offset, bufs, seq)


def _read(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
    s.read_into(ticket, extent_id, offset, bufs)


def _accumulate(dt: DType, alpha: float | None = None) -> BufferOp:
    """The accumulate (``alpha`` None) or axpy request of one task."""
    def op(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
        s.accumulate(ticket, extent_id, offset, bufs, dt, alpha, seq)
    return op
