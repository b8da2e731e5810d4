"""Region handles: typed reads, writes and server-side arithmetic on a named buffer.

A :class:`Region` turns a region-relative operation into requests against extents
(via the pure layout in :mod:`smb_protocol.placement`), sends the requests for different
servers in parallel, and waits for all of them. Every operation has an ``*_async``
form returning a :class:`concurrent.futures.Future` and an ``a*`` coroutine for
asyncio (:mod:`.region_async`).

A region holds no connections: its :class:`~smb_client.route.Route` (one per region
handle) maps each request's layout slot to a data-plane session of the client (one per
memory-server endpoint, shared by every region), hands each request the region's
ticket, numbers mutating requests, and runs every operation under ticket renewal,
failover and the check that the handle still names the region it opened (see
:mod:`smb_client.route`).

Concurrency rules (enforced by the memory servers): accumulates into one range are
serialized per extent; writes are last-writer-wins; a reader that needs a consistent
snapshot uses a version word or a lock built on :meth:`Region.compare_swap`.

The route lives in :mod:`.route`; locks and barriers in :mod:`.coord`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from smb_protocol.dtypes import STORAGE, DType, itemsize, resolve
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned
from smb_protocol.placement import ExtentPlace, Layout, Run
from smb_protocol.tickets import TicketMode
from smb_protocol.wire import WaitCond

from . import cuda, cuda_region
from .buffers import as_view, typed_view
from .metrics import timed_method
from .region_async import AsyncForms
from .region_batched import BatchedForms, BufferOp, _accumulate, _read, _write
from .retrying import in_slices, until
from .route import RegionSource, Route, layout_of

log = logging.getLogger(__name__)

FLOATING_TYPES = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64)

__all__ = ["Region", "ExtentPlace", "layout_of"]


class Region(BatchedForms, AsyncForms):
    """A handle on one region (one incarnation: :attr:`uid`), under one ticket (renewed
    as needed). Uses the client's data plane through its :attr:`route`; the client must
    outlive it. :meth:`close` is kept for ``with`` blocks: the connections belong to the
    client. Once the region is deleted (and perhaps created again under the same name),
    every operation raises :class:`~smb_protocol.errors.RegionNotFound`."""

    def __init__(self, client: RegionSource, info: Any, ticket: Any, mode: str | TicketMode) -> None:
        self.route = Route(client, info, ticket, mode)   # the one way its requests reach the servers

    @property
    def client(self) -> RegionSource:
        """The client that opened this region (borrowed)."""
        return self.route.source

    @property
    def mode(self) -> TicketMode:
        """``rw`` or ``ro``: what the ticket allows."""
        return self.route.mode

    @property
    def name(self) -> str:
        """The region's name (``namespace/...``)."""
        return self.route.name

    @property
    def uid(self) -> str:
        """The incarnation this handle is bound to (a region of the same name created
        later has another)."""
        return self.route.uid

    @property
    def size(self) -> int:
        """Bytes."""
        return self.route.size

    @property
    def placement(self) -> str:
        """``striped``, ``layered`` or ``single``."""
        return self.route.placement

    @property
    def stripe_unit(self) -> int:
        """Bytes per stripe (striped placement)."""
        return self.route.stripe_unit

    @property
    def state(self) -> str:
        """ready, degraded or lost, as the controller said when last asked."""
        return self.route.state

    @property
    def layout(self) -> Layout:
        """Where each byte lives: the pure offset -> (extent, offset) mapping."""
        return self.route.layout

    @property
    def extents(self) -> tuple[ExtentPlace, ...]:
        """Each layout slot's extent (a replicated region's: the slot's primary copy)."""
        return self.route.extents

    @property
    def replicas(self) -> int:
        """Copies of every byte (1 to 3)."""
        return self.route.replicas

    @property
    def copies(self) -> tuple[ExtentPlace, ...]:
        """The other copies of every slot (backups, and copies being synced)."""
        return self.route.copies

    def __repr__(self) -> str:
        return (f"Region({self.name!r}, size={self.size}, placement={self.placement!r}, "
                f"servers={len(self.extents)}, mode={self.mode.value!r})")

    def __enter__(self) -> Region:
        """The region itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close`."""
        self.close()

    def close(self) -> None:
        """Nothing to release: the sessions are the client's, shared by its regions."""

    def refresh(self) -> None:
        """Open the region again: a fresh ticket and the current server list
        (RegionNotFound once its name belongs to another region)."""
        self.route.refresh()

    def transports(self) -> dict[str, str]:
        """The transport used for each server of this region (opening sessions); for a
        replicated region, the one its reads use (mutations go to the primary's tcp plane)."""
        return self.route.transports()

    # -- planning ------------------------------------------------------------------
    def _tasks(self, offset: int, view: memoryview, align: int, op: BufferOp,
               numbered: bool = True) -> list[Callable[[], Any]]:
        """One task per request; each reads the route's current ticket and copy when it
        runs and keeps the sequence number given here (``numbered``: a mutating request)."""
        route = self.route

        def task(run: Run, bufs: list[memoryview]) -> Callable[[], Any]:
            seq = route.next_seq() if numbered else 0
            return lambda: route.request(run.extent, numbered, lambda s, place: op(
                s, route.ticket, place.extent_id, run.extent_offset, bufs, seq))
        return [task(run, [view[ro - offset:ro - offset + n] for ro, n in run.parts])
                for run in route.chunks(offset, len(view), align)]

    # -- bytes ---------------------------------------------------------------------
    @timed_method("write")
    def write(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes, numpy array, torch tensor) at ``offset`` bytes."""
        if cuda.is_cuda(data):
            return cuda_region.write(self, offset, data)
        self.route.check_writable()
        view, _ = as_view(data)
        self.layout.check_range(offset, len(view))
        tasks = self._tasks(offset, view, 1, _write)
        self.route.run_all(tasks)

    @timed_method("read")
    def read_into(self, offset: int, out: Any) -> Any:
        """Fill the writable buffer ``out`` from ``offset``; returns ``out``."""
        if cuda.is_cuda(out):
            return cuda_region.read_into(self, offset, out)
        view, _ = as_view(out, writable=True)
        self.layout.check_range(offset, len(view))
        tasks = self._tasks(offset, view, 1, _read, numbered=False)
        self.route.run_all(tasks)
        return out

    def read(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Any:
        """``length`` bytes from ``offset`` (default: to the end), as a bytearray, or as a
        numpy array of ``dtype`` (bfloat16 comes back as its uint16 bit patterns)."""
        if isinstance(length, str):   # read(0, "float32"): the type where the length goes
            raise InvalidArgument(f"read(offset, length, dtype): the length {length!r} is a type; pass it as "
                                  f"dtype=, e.g. read({offset!r}, dtype={length!r}) for the rest of the region")
        if length is None:
            length = self.size - offset
        self.layout.check_range(offset, length)
        if dtype is None:
            return self.read_into(offset, bytearray(length))
        dt = resolve(dtype)
        if length % itemsize(dt):
            raise Misaligned(f"{length} bytes is not a whole number of {dt.name.lower()} elements")
        return self.read_into(offset, np.empty(length // itemsize(dt), dtype=STORAGE[dt]))

# -- server-side arithmetic ----------------------------------------------------
    def _typed(self, offset: int, data: Any, dtype: Any) -> tuple[memoryview, DType]:
        view, dt = typed_view(data, dtype)
        size = itemsize(dt)
        if offset % size or len(view) % size:
            raise Misaligned(f"offset {offset} and length {len(view)} must be multiples of {size} "
                             f"for {dt.name.lower()}")
        self.layout.check_range(offset, len(view))
        return view, dt

    @timed_method("accumulate")
    def accumulate(self, offset: int, data: Any, dtype: Any = None) -> None:
        """Server-side ``region[offset:] += data`` elementwise."""
        if cuda.is_cuda(data):
            return cuda_region.accumulate(self, offset, data, dtype)
        self.route.check_writable()
        view, dt = self._typed(offset, data, dtype)
        tasks = self._tasks(offset, view, itemsize(dt), _accumulate(dt))
        self.route.run_all(tasks)

    @timed_method("axpy")
    def axpy(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> None:
        """Server-side ``region[offset:] += alpha * x`` elementwise (a floating type)."""
        if cuda.is_cuda(x):
            return cuda_region.accumulate(self, offset, x, dtype, alpha=alpha)
        self.route.check_writable()
        view, dt = self._typed(offset, x, dtype)
        if dt not in FLOATING_TYPES:
            raise DtypeError(f"axpy needs a floating type, not {dt.name.lower()}")
        tasks = self._tasks(offset, view, itemsize(dt), _accumulate(dt, float(alpha)))
        self.route.run_all(tasks)

    @timed_method("scale")
    def scale(self, offset: int, length: int, alpha: float, dtype: Any) -> None:
        """Server-side ``region[offset:offset+length] *= alpha`` (length in bytes)."""
        self.route.check_writable()
        dt = resolve(dtype)
        if dt not in FLOATING_TYPES:
            raise DtypeError(f"scale needs a floating type, not {dt.name.lower()}")
        size = itemsize(dt)
        if offset % size or length % size:
            raise Misaligned(f"offset {offset} and length {length} must be multiples of {size}")
        self.layout.check_range(offset, length)
        a = float(alpha)

        route = self.route

        def task(run: Run) -> Callable[[], None]:
            seq = route.next_seq()
            return lambda: route.request(run.extent, True, lambda s, place: s.scale(
                route.ticket, place.extent_id, run.extent_offset, run.length, dt, a, seq))
        tasks = [task(r) for r in route.chunks(offset, length, size)]
        self.route.run_all(tasks)

    @timed_method("fetch_add")
    def fetch_add(self, offset: int, value: int) -> int:
        """Atomically add ``value`` to the int64 at ``offset``; returns the old value."""
        route = self.route
        route.check_writable()
        slot, eoff = route.word(offset)
        seq = route.next_seq()
        return int(route.run(lambda: route.request(slot, True, lambda s, place: s.fetch_add(
            route.ticket, place.extent_id, eoff, int(value), seq))))

    @timed_method("compare_swap")
    def compare_swap(self, offset: int, expected: int, desired: int) -> int:
        """Atomically set the int64 at ``offset`` to ``desired`` if it equals ``expected``;
        returns the old value (equal to ``expected`` when the swap happened)."""
        route = self.route
        route.check_writable()
        slot, eoff = route.word(offset)
        seq = route.next_seq()
        return int(route.run(lambda: route.request(slot, True, lambda s, place: s.compare_swap(
            route.ticket, place.extent_id, eoff, int(expected), int(desired), seq))))

    @timed_method("wait")
    def wait(self, offset: int, *, value: int | None = None, equals: int | None = None,
             changed_from: int | None = None, timeout: float | None = None) -> int:
        """Block, without polling, until the int64 at ``offset`` is ``>= value``, ``== equals``
        or ``!= changed_from`` (exactly one of them); returns the word then.

        ``timeout`` (seconds; None: for ever) raises :class:`~smb_protocol.errors.Timeout`.
        The wait is served by the word's memory server (see :mod:`.coord`).
        """
        given = [(c, v) for c, v in ((WaitCond.AT_LEAST, value), (WaitCond.EQUAL, equals),
                                     (WaitCond.CHANGED, changed_from)) if v is not None]
        if len(given) != 1:
            raise InvalidArgument("wait for exactly one of value= (>=), equals= or changed_from=")
        cond, target = given[0]
        deadline = until(timeout)
        route = self.route
        slot, eoff = route.word(offset)
        return in_slices(deadline, lambda left: route.coordinate(slot, lambda s, place: s.wait(
            route.ticket, place.extent_id, eoff, cond, int(target), left)))
