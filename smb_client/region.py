"""Region handles: typed reads, writes and server-side arithmetic on a named buffer.

A :class:`Region` turns a region-relative operation into requests against extents
(via the pure layout in :mod:`smb_protocol.placement`), sends the requests for different
servers in parallel, and waits for all of them. Every operation has an ``*_async``
form returning a :class:`concurrent.futures.Future`.

A region holds no connections: it borrows its client's data-plane sessions (one per
memory-server endpoint, shared by every region) and hands each request its own ticket.

Concurrency rules (enforced by the memory servers): accumulates into one range are
serialized per extent; writes are last-writer-wins; a reader that needs a consistent
snapshot uses a version word or a lock built on :meth:`Region.compare_swap`.

The module is longer than 400 lines on purpose: every operation's planning, its
exactly-once numbering and its retry under a renewed ticket share one set of helpers
and read best together; waits, locks and barriers live in :mod:`.coord`.

Exactly once: an operation is planned once into requests, and every mutating request gets
its sequence number then (:meth:`DataPlane.next_seq`). When the operation runs again (a
ticket the server called expired, renewed; a connection that broke, on another one; a
replicated region's primary that died, at the backup promoted in its place), the same
requests with the same numbers are sent: those that took effect are answered with their
first answer by the server and not applied twice.

Replicated regions (``replicas`` > 1): every mutating request goes to its slot's
*primary* copy over the primary server's tcp plane (the primary orders mutations and
forwards them to the backups before it answers); reads go to the nearest live copy (one
on this host over shm, else the primary). A request is planned by layout slot, and the
copy it goes to is looked up when it runs, so a retry after a failover reaches the new
primary. When a server does not answer or a copy says it is not the primary, the region
opens itself again and runs the operation again with the same numbers, for up to
:data:`FAILOVER_TIMEOUT` seconds (the controller needs a server lease to notice a dead
server and promote a backup).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from smb_client import coord
from smb_protocol import errors
from smb_protocol.dtypes import STORAGE, DType, itemsize, resolve
from smb_protocol.errors import DtypeError, InvalidArgument, Misaligned, ReadOnly, TicketExpired
from smb_protocol.placement import ExtentPlace, Layout, Run, split_runs
from smb_protocol.retry import Backoff, Retry
from smb_protocol.tickets import TicketMode

from .buffers import as_view
from .transports import Session

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger(__name__)

REFRESH_MARGIN = 60.0      # seconds before expiry a ticket is renewed
REFRESH_TIMEOUT = 2.0      # seconds an operation keeps renewing a ticket the server calls expired
EXPLAIN_PATIENCE = 0.5     # seconds a failed operation waits for the controller to say why
FAILOVER_TIMEOUT = 30.0    # seconds an operation on a replicated region waits for a live primary
AVOID_SECONDS = 10.0       # seconds a replicated region reads from other copies than a failed server's
FLOATING_TYPES = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64)

__all__ = ["Region", "ExtentPlace", "layout_of"]

#: op(session, ticket, extent_id, extent_offset, buffers, seq)
BufferOp = Callable[[Session, str, int, int, list[memoryview], int], Any]


def layout_of(info: Any) -> Layout:
    lengths = tuple(e.length for e in info.extents)
    if info.placement == "striped":
        layout = Layout.striped(info.size, info.stripe_unit, len(lengths))
    elif info.placement == "layered":
        layout = Layout.layered(list(info.segment_sizes), list(info.segment_servers))
    else:
        layout = Layout.single(info.size)
    if layout.extent_lengths != lengths:
        raise InvalidArgument(f"region {info.name}: extent lengths {lengths} do not match its layout")
    return layout


class Region:
    """A handle on a named region, under one ticket (renewed as needed). Uses the
    client's data plane; the :class:`Client` must outlive it. :meth:`close` is kept
    for ``with`` blocks: the connections belong to the client."""

    def __init__(self, client: Client, info: Any, ticket: Any, mode: str | TicketMode) -> None:
        self._client = client
        self._dataplane = client.dataplane
        self.mode = TicketMode(mode)
        self._lock = threading.Lock()
        self._avoid: dict[str, float] = {}   # server id -> monotonic time until which reads avoid it
        self._apply(info, ticket)

    def _apply(self, info: Any, ticket: Any) -> None:
        self.name: str = info.name
        self.uid: str = info.uid
        self.size: int = info.size
        self.placement: str = info.placement
        self.stripe_unit: int = info.stripe_unit
        self.state: str = info.state
        self.layout = layout_of(info)
        #: each layout slot's extent (a replicated region's: the slot's primary copy)
        self.extents: tuple[ExtentPlace, ...] = tuple(ExtentPlace.from_message(e) for e in info.extents)
        self.replicas: int = max(1, int(getattr(info, "replicas", 0) or 1))
        #: the other copies of every slot (backups, and copies being synced)
        self.copies: tuple[ExtentPlace, ...] = tuple(ExtentPlace.from_message(c)
                                                     for c in getattr(info, "copies", ()))
        self._dataplane.learn((*self.extents, *self.copies))   # where the servers listen now
        self._readers = tuple(self._nearest(slot) for slot in range(len(self.extents)))
        self._ticket: str = ticket.token
        self._expires_at: float = ticket.expires_at

    def _nearest(self, slot: int) -> ExtentPlace:
        """The copy of ``slot`` reads go to: a live copy on this host (shm), else the
        primary, else a live backup; servers that failed lately come last."""
        primary = self.extents[slot]
        if self.replicas == 1:
            return primary
        backups = [c for c in self.copies if c.index == slot and c.role == "backup"]
        here = self._dataplane.here
        avoid = self._avoid
        now = time.monotonic()

        def rank(p: ExtentPlace) -> tuple[int, int, int]:
            failed = avoid.get(p.server_id, 0.0) > now
            local = p.host_id == here and any(u.startswith("shm://") for u in p.endpoints)
            return (int(failed or p.server_state == "down"), int(not local), int(p is not primary))
        return min([primary, *backups], key=rank)

    def __repr__(self) -> str:
        return (f"Region({self.name!r}, size={self.size}, placement={self.placement!r}, "
                f"servers={len(self.extents)}, mode={self.mode.value!r})")

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: the sessions are the client's, shared by its regions."""

    # -- plumbing ------------------------------------------------------------------
    def refresh(self) -> None:
        """Open the region again: a fresh ticket and the current server list."""
        info, ticket = self._client.open_info(self.name, self.mode)
        with self._lock:
            self._apply(info, ticket)

    def transports(self) -> dict[str, str]:
        """The transport used for each server of this region (opening sessions); for a
        replicated region, the one its reads use (mutations go to the primary's tcp plane)."""
        return {p.server_id: self._session(p).scheme for p in (*self.extents, *self.copies)
                if p.role != "syncing"}

    def _session(self, place: ExtentPlace) -> Session:
        return self._dataplane.session(place)

    def _target(self, slot: int, mutate: bool) -> tuple[Session, ExtentPlace]:
        """The session and copy a request on layout slot ``slot`` goes to now: a
        replicated region's mutations go to the primary's tcp plane, its reads to the
        nearest live copy; an unreplicated region's requests to the slot's extent over
        the transport chosen for its server."""
        if self.replicas == 1:
            place = self.extents[slot]
            return self._session(place), place
        if mutate:
            place = self.extents[slot]
            return self._dataplane.coordination(place), place
        place = self._readers[slot]
        return self._session(place), place

    def _failed(self, place: ExtentPlace) -> None:
        """Reads of a replicated region avoid ``place``'s server for a while."""
        if self.replicas > 1:
            with self._lock:
                self._avoid[place.server_id] = time.monotonic() + AVOID_SECONDS
                self._readers = tuple(self._nearest(slot) for slot in range(len(self.extents)))

    def _request(self, slot: int, mutate: bool, send: Callable[[Session, ExtentPlace], Any]) -> Any:
        """Send one request on ``slot`` to the copy :meth:`_target` names when it runs."""
        session, place = self._target(slot, mutate)
        try:
            return send(session, place)
        except errors.ServerUnavailable:
            self._failed(place)
            raise

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under a fresh ticket; after TicketExpired, renew the ticket and run
        it again (with backoff, for up to :data:`REFRESH_TIMEOUT` seconds). ``fn`` must
        send the same numbered requests each time it runs (plan them outside ``fn``)."""
        if time.time() > self._expires_at - REFRESH_MARGIN:
            self.refresh()
        try:
            if self.replicas > 1:
                return self._failing_over(fn)
            return self._retrying_once(fn)
        except (errors.ServerUnavailable, errors.ExtentNotFound) as exc:
            self._explain(exc)
            raise

    def _failing_over(self, fn: Callable[[], Any]) -> Any:
        """:meth:`_retrying_once` for a replicated region: also after a server that did
        not answer, a copy that is no longer the primary (NotPrimary) or an extent a
        server no longer holds (a copy the controller replaced), open the region again and
        run ``fn`` again, for up to :data:`FAILOVER_TIMEOUT` seconds. The controller
        being unreachable meanwhile is waited out the same way; a region deleted or lost
        meanwhile raises from the reopening."""
        attempts = 0

        def attempt() -> Any:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self.refresh()
            return fn()
        retry = Retry(on=(TicketExpired, errors.Unavailable, errors.ExtentNotFound),
                      timeout=FAILOVER_TIMEOUT, backoff=Backoff(first=0.02, cap=0.5))
        return retry(attempt, what=f"region {self.name}")

    def _explain(self, exc: errors.SMBError) -> None:
        """After a server was unreachable or no longer held an extent, ask the controller
        what became of the region: a region that is ``lost`` (its server came back
        without its memory) raises :class:`~.errors.RegionLost` instead, chained to ``exc``; a
        deleted one keeps ``exc`` (ExtentNotFound is a RegionNotFound). The operation is
        not run again (part of it may have taken effect)."""
        try:
            info, ticket = self._client.open_info(self.name, self.mode, reconnect_timeout=EXPLAIN_PATIENCE)
        except errors.RegionLost as why:
            raise why from exc
        except errors.SMBError:
            log.debug("region %s: controller not reachable to explain %r", self.name, exc)
            return
        with self._lock:
            self._apply(info, ticket)      # the servers' current endpoints for the next operation

    def _retrying_once(self, fn: Callable[[], Any]) -> Any:
        try:                  # the common case first: no retry policy built per operation
            return fn()
        except TicketExpired:
            pass

        def attempt() -> Any:
            self.refresh()
            return fn()
        retry = Retry(on=(TicketExpired,), timeout=REFRESH_TIMEOUT, backoff=Backoff(first=0.01, cap=0.2))
        return retry(attempt, what=f"region {self.name}")

    def _run(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        return self._dataplane.run(tasks)

    def _chunks(self, offset: int, length: int, align: int = 1) -> list[Run]:
        return split_runs(self.layout.runs(offset, length), self._client.chunk_bytes, align)

    def _tasks(self, offset: int, view: memoryview, align: int, op: BufferOp,
               numbered: bool = True) -> list[Callable[[], Any]]:
        """One task per request; each reads the region's current ticket and copy when it
        runs and keeps the sequence number given here (``numbered``: a mutating request)."""
        def task(run: Run, bufs: list[memoryview]) -> Callable[[], Any]:
            seq = self._dataplane.next_seq() if numbered else 0
            return lambda: self._request(run.extent, numbered, lambda s, place: op(
                s, self._ticket, place.extent_id, run.extent_offset, bufs, seq))
        return [task(run, [view[ro - offset:ro - offset + n] for ro, n in run.parts])
                for run in self._chunks(offset, len(view), align)]

    def _check_writable(self) -> None:
        if not self.mode.writes:
            raise ReadOnly(f"region {self.name} was opened read-only")

    # -- bytes ---------------------------------------------------------------------
    def write(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes, numpy array, torch CPU tensor) at ``offset`` bytes."""
        self._check_writable()
        view, _ = as_view(data)
        self.layout.check_range(offset, len(view))
        tasks = self._tasks(offset, view, 1, _write)
        self._retrying(lambda: self._run(tasks))

    def read_into(self, offset: int, out: Any) -> Any:
        """Fill the writable buffer ``out`` from ``offset``; returns ``out``."""
        view, _ = as_view(out, writable=True)
        self.layout.check_range(offset, len(view))
        tasks = self._tasks(offset, view, 1, _read, numbered=False)
        self._retrying(lambda: self._run(tasks))
        return out

    def read(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Any:
        """``length`` bytes from ``offset`` (default: to the end), as a bytearray, or as a
        numpy array of ``dtype`` (bfloat16 comes back as its uint16 bit patterns)."""
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
        view, inferred = as_view(data)
        if dtype is None and inferred is None:
            raise DtypeError("pass dtype= for untyped buffers (float32, float16, bfloat16, float64, int32, int64)")
        dt = resolve(dtype) if dtype is not None else inferred
        assert dt is not None
        if inferred is not None and dtype is not None and inferred != dt:
            raise DtypeError(f"buffer holds {inferred.name.lower()}, dtype {dt.name.lower()} asked for")
        size = itemsize(dt)
        if offset % size or len(view) % size:
            raise Misaligned(f"offset {offset} and length {len(view)} must be multiples of {size} "
                             f"for {dt.name.lower()}")
        self.layout.check_range(offset, len(view))
        return view, dt

    def accumulate(self, offset: int, data: Any, dtype: Any = None) -> None:
        """Server-side ``region[offset:] += data`` elementwise."""
        self._check_writable()
        view, dt = self._typed(offset, data, dtype)
        tasks = self._tasks(offset, view, itemsize(dt), _accumulate(dt))
        self._retrying(lambda: self._run(tasks))

    def axpy(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> None:
        """Server-side ``region[offset:] += alpha * x`` elementwise (a floating type)."""
        self._check_writable()
        view, dt = self._typed(offset, x, dtype)
        if dt not in FLOATING_TYPES:
            raise DtypeError(f"axpy needs a floating type, not {dt.name.lower()}")
        tasks = self._tasks(offset, view, itemsize(dt), _accumulate(dt, float(alpha)))
        self._retrying(lambda: self._run(tasks))

    def scale(self, offset: int, length: int, alpha: float, dtype: Any) -> None:
        """Server-side ``region[offset:offset+length] *= alpha`` (length in bytes)."""
        self._check_writable()
        dt = resolve(dtype)
        if dt not in FLOATING_TYPES:
            raise DtypeError(f"scale needs a floating type, not {dt.name.lower()}")
        size = itemsize(dt)
        if offset % size or length % size:
            raise Misaligned(f"offset {offset} and length {length} must be multiples of {size}")
        self.layout.check_range(offset, length)
        a = float(alpha)

        def task(run: Run) -> Callable[[], None]:
            seq = self._dataplane.next_seq()
            return lambda: self._request(run.extent, True, lambda s, place: s.scale(
                self._ticket, place.extent_id, run.extent_offset, run.length, dt, a, seq))
        tasks = [task(r) for r in self._chunks(offset, length, size)]
        self._retrying(lambda: self._run(tasks))

    def _word(self, offset: int) -> tuple[ExtentPlace, int]:
        slot, eoff = self._slot_word(offset)
        return self.extents[slot], eoff

    def _slot_word(self, offset: int) -> tuple[int, int]:
        """The layout slot and extent offset of the int64 word at ``offset``."""
        if offset % 8:
            raise Misaligned(f"atomic word offset {offset} is not 8-byte aligned")
        pieces = self.layout.map(offset, 8)
        if len(pieces) != 1:
            raise Misaligned(f"word at {offset} straddles two extents")
        return pieces[0].extent, pieces[0].extent_offset

    def fetch_add(self, offset: int, value: int) -> int:
        """Atomically add ``value`` to the int64 at ``offset``; returns the old value."""
        self._check_writable()
        slot, eoff = self._slot_word(offset)
        seq = self._dataplane.next_seq()
        return int(self._retrying(lambda: self._request(slot, True, lambda s, place: s.fetch_add(
            self._ticket, place.extent_id, eoff, int(value), seq))))

    def compare_swap(self, offset: int, expected: int, desired: int) -> int:
        """Atomically set the int64 at ``offset`` to ``desired`` if it equals ``expected``;
        returns the old value (equal to ``expected`` when the swap happened)."""
        self._check_writable()
        slot, eoff = self._slot_word(offset)
        seq = self._dataplane.next_seq()
        return int(self._retrying(lambda: self._request(slot, True, lambda s, place: s.compare_swap(
            self._ticket, place.extent_id, eoff, int(expected), int(desired), seq))))

    def wait(self, offset: int, *, value: int | None = None, equals: int | None = None,
             changed_from: int | None = None, timeout: float | None = None) -> int:
        """Block, without polling, until the int64 at ``offset`` is ``>= value``, ``== equals``
        or ``!= changed_from``; returns it. Timeout after ``timeout`` s (see :mod:`.coord`)."""
        return coord.wait(self, offset, value=value, equals=equals, changed_from=changed_from, timeout=timeout)

    # -- batched forms -------------------------------------------------------------
    def _many(self, items: Iterable[tuple[int, Any]], fn: Callable[[int, Any], list[Callable[[], Any]]]) -> None:
        tasks: list[Callable[[], Any]] = []
        for offset, data in items:
            tasks.extend(fn(offset, data))
        if tasks:
            self._retrying(lambda: self._run(tasks))

    def write_many(self, items: Iterable[tuple[int, Any]]) -> None:
        """Write several ``(offset, data)`` pairs, all servers in parallel."""
        self._check_writable()

        def plan(offset: int, data: Any) -> list[Callable[[], Any]]:
            view, _ = as_view(data)
            self.layout.check_range(offset, len(view))
            return self._tasks(offset, view, 1, _write)
        self._many(items, plan)

    def read_many(self, items: Iterable[tuple[int, Any]]) -> list[Any]:
        """Fill several ``(offset, out)`` buffers, all servers in parallel; returns the
        buffers, in order (as :meth:`read_into` returns its buffer)."""
        outs: list[Any] = []

        def plan(offset: int, out: Any) -> list[Callable[[], Any]]:
            view, _ = as_view(out, writable=True)
            self.layout.check_range(offset, len(view))
            outs.append(out)
            return self._tasks(offset, view, 1, _read, numbered=False)
        self._many(items, plan)
        return outs

    def fetch_add_many(self, items: Iterable[tuple[int, int]]) -> list[int]:
        """``fetch_add`` of each ``(offset, value)``; returns the old values in order.

        Words of one extent go to its server as one batch (over rdma: pipelined atomics
        on one queue pair, one round trip's wait for the lot); servers run in parallel.
        Every word is checked (alignment, bounds) before any is touched. Each add is
        atomic; the batch is not (another client's atomics may interleave).
        """
        self._check_writable()
        batches: dict[int, tuple[int, list[int], list[tuple[int, int]]]] = {}
        n = 0
        for offset, value in items:
            slot, eoff = self._slot_word(offset)
            _, where, ops = batches.setdefault(slot, (slot, [], []))
            where.append(n)
            ops.append((eoff, int(value)))
            n += 1
        olds = [0] * n

        def batch(slot: int, where: list[int], ops: list[tuple[int, int]]) -> Callable[[], None]:
            seq = self._dataplane.next_seq()      # word k of the batch: seq + k
            def run() -> None:
                got = self._request(slot, True, lambda s, place: s.fetch_add_many(
                    self._ticket, place.extent_id, ops, seq))
                for k, old in zip(where, got, strict=True):
                    olds[k] = old
            return run
        tasks = [batch(*b) for b in batches.values()]
        if tasks:
            self._retrying(lambda: self._run(tasks))
        return olds

    def accumulate_many(self, items: Iterable[tuple[int, Any]], dtype: Any = None) -> None:
        """Accumulate several ``(offset, data)`` pairs, all servers in parallel."""
        self._check_writable()

        def plan(offset: int, data: Any) -> list[Callable[[], Any]]:
            view, dt = self._typed(offset, data, dtype)
            return self._tasks(offset, view, itemsize(dt), _accumulate(dt))
        self._many(items, plan)

    # -- asynchronous forms --------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        return self._dataplane.submit(fn, *args, **kwargs)

    def write_async(self, offset: int, data: Any) -> Future[Any]:
        return self._submit(self.write, offset, data)

    def read_into_async(self, offset: int, out: Any) -> Future[Any]:
        return self._submit(self.read_into, offset, out)

    def read_async(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Future[Any]:
        return self._submit(self.read, offset, length, dtype)

    def accumulate_async(self, offset: int, data: Any, dtype: Any = None) -> Future[Any]:
        return self._submit(self.accumulate, offset, data, dtype)

    def axpy_async(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> Future[Any]:
        return self._submit(self.axpy, offset, x, alpha, dtype)

    def scale_async(self, offset: int, length: int, alpha: float, dtype: Any) -> Future[Any]:
        return self._submit(self.scale, offset, length, alpha, dtype)

    def fetch_add_async(self, offset: int, value: int) -> Future[Any]:
        return self._submit(self.fetch_add, offset, value)

    def compare_swap_async(self, offset: int, expected: int, desired: int) -> Future[Any]:
        return self._submit(self.compare_swap, offset, expected, desired)

    def write_many_async(self, items: Sequence[tuple[int, Any]]) -> Future[Any]:
        return self._submit(self.write_many, items)

    def read_many_async(self, items: Sequence[tuple[int, Any]]) -> Future[Any]:
        """A future of :meth:`read_many`'s list of buffers."""
        return self._submit(self.read_many, items)

    def accumulate_many_async(self, items: Sequence[tuple[int, Any]], dtype: Any = None) -> Future[Any]:
        return self._submit(self.accumulate_many, items, dtype)

    def fetch_add_many_async(self, items: Sequence[tuple[int, int]]) -> Future[Any]:
        """A future of :meth:`fetch_add_many`'s old values."""
        return self._submit(self.fetch_add_many, items)


def _write(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
    s.write(ticket, extent_id, offset, bufs, seq)


def _read(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
    s.read_into(ticket, extent_id, offset, bufs)


def _accumulate(dt: DType, alpha: float | None = None) -> BufferOp:
    """The accumulate (``alpha`` None) or axpy request of one task."""
    def op(s: Session, ticket: str, extent_id: int, offset: int, bufs: list[memoryview], seq: int) -> None:
        s.accumulate(ticket, extent_id, offset, bufs, dt, alpha, seq)
    return op
