"""The one route from a region handle to its memory servers.

A :class:`Route` belongs to one incarnation of one region (its ``uid``): it maps every
layout slot to the copy a request goes to and the data-plane session that reaches it,
holds the region's ticket (renewed as needed), numbers mutating requests, and runs
operations under retry and failover. :class:`~smb_client.region.Region` plans its
operations into requests on slots and hands them to its route; waits, locks and barriers
(:mod:`smb_client.coord`) send theirs through the same route (:meth:`Route.coordinate`),
and a collective's chunks go on the stream the route hands out for their slot
(:meth:`Route.stream`) under the same retry decision (:class:`Retrying`), so every rule
below holds for all::

    Region / Lock / Barrier / Collective             Collective's exchanger
        -> Route.run (ticket renewal, failover,        -> Route.stream(slot), Retrying
           explain)   one per operation
        -> Route.request / Route.coordinate (slot -> place, session)
        -> DataPlane.session / DataPlane.coordination      (endpoint -> Session)
        -> Session (tcp, shm, rdma) -> connections -> socket / mapping / queue pair

Exactly once: an operation is planned once into requests, and every mutating request gets
its sequence number then (:meth:`Route.next_seq`). When the operation runs again (a
ticket the server called expired, renewed; a connection that broke, on another one; a
replicated region's primary that died, at the backup promoted in its place), the same
requests with the same numbers are sent: those that took effect are answered with their
first answer by the server and not applied twice.

Replicated regions (``replicas`` > 1): every mutating request goes to its slot's
*primary* copy over the primary server's tcp plane (the primary orders mutations and
forwards them to the backups before it answers); reads go to the nearest live copy (one
on this host over shm, else the primary). A request is planned by layout slot, and the
copy it goes to is looked up when it runs, so a retry after a failover reaches the new
primary. When a server does not answer or a copy says it is not the primary, the route
opens the region again and runs the operation again with the same numbers, for up to
:data:`FAILOVER_TIMEOUT` seconds (the controller needs a server lease to notice a dead
server and promote a backup).

Moves (an evacuated server, a rebalance): the controller copies a slot's extent to
another server while clients use it and then switches the slot over, releasing the old
extent. While a move is under way the region's description lists the new copy, and
the route sends an unreplicated region's mutations to the moving extent's tcp plane
too (which forwards them to the copy; shared memory learns the same from the extent's
header, :mod:`.transports.shm`). A request that finds its extent released or its server
refusing it (the switch) makes the route open the region again; when the slot's extent
changed or a move is under way, the operation runs again, with the same numbers, at
the slot's extent now, as after a failover: handles follow a move without reopening.

One incarnation: the route opens its region again by name (a renewed ticket, a
failover, an explanation of an error), and adopts the answer only when it describes the
same region (the same ``uid``). A region deleted and created again under the same name
is another region: the route then refuses every later operation with
:class:`~smb_protocol.errors.RegionNotFound`, and never reaches the new region.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from smb_protocol import errors
from smb_protocol.errors import InvalidArgument, Misaligned, ReadOnly, RegionNotFound, TicketExpired
from smb_protocol.placement import ExtentPlace, Layout, Run, split_runs
from smb_protocol.replicas import ReplicaRole
from smb_protocol.retry import Backoff, Retry
from smb_protocol.tickets import TicketMode

from .dataplane import DataPlane
from .retrying import FAILOVER_TIMEOUT, move_backoff
from .transports import Session
from .transports.stream import Reducer

log = logging.getLogger(__name__)

T = TypeVar("T")

REFRESH_MARGIN = 60.0      # seconds before expiry a ticket is renewed
REFRESH_TIMEOUT = 2.0      # seconds an operation keeps renewing a ticket the server calls expired
EXPLAIN_PATIENCE = 0.5     # seconds a failed operation waits for the controller to say why
AVOID_SECONDS = 10.0       # seconds a replicated region reads from other copies than a failed server's
__all__ = ["Route", "RegionSource", "layout_of"]


class RegionSource(Protocol):
    """What a route needs of the client that opened its region
    (a :class:`~smb_client.client.Client`)."""

    dataplane: DataPlane
    chunk_bytes: int

    def open_info(self, name: str, mode: str | TicketMode = TicketMode.RW,
                  reconnect_timeout: float | None = None) -> tuple[Any, Any]: ...

    def delete_region(self, name: str) -> None: ...


def layout_of(info: Any) -> Layout:
    """The layout of a region description (a protobuf ``RegionInfo``)."""
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


def failed_at(exc: errors.ServerUnavailable | errors.ExtentNotFound, place: ExtentPlace) -> None:
    """Remember on ``exc`` the extent its request went to (the first one it failed at,
    for :func:`_left`) and, for an unavailable server, name the server in its message."""
    if getattr(exc, "sent_to", None) is None:
        exc.sent_to = place.extent_id   # type: ignore[union-attr]
    if isinstance(exc, errors.ServerUnavailable):
        name_server(exc, place.server_id)


def _left(exc: BaseException, places: Sequence[tuple[int, str]]) -> bool:
    """Whether the extent ``exc``'s request went to is none of the region's now: the
    region moved it, perhaps before this operation looked (another operation on the
    handle may have learned the move while this one's request was on its way)."""
    extent = getattr(exc, "sent_to", None)
    return extent is not None and extent not in {e for e, _ in places}


def name_server(exc: errors.ServerUnavailable, server_id: str) -> None:
    """Put memory server ``server_id`` and where to look (``smb status``) into the
    message of ``exc`` (same class, same traceback), unless it names the server already."""
    text = str(exc)
    if server_id and server_id not in text:
        exc.args = (f"memory server {server_id}: {text}; `smb status` shows its state",)


class Route:
    """Slot -> (session, copy), the ticket, request numbers, retry and failover of one
    region incarnation (``uid``), opened through ``source`` in ``mode``. Borrows the
    source's data plane; owns nothing that needs closing."""

    def __init__(self, source: RegionSource, info: Any, ticket: Any, mode: str | TicketMode) -> None:
        self.source = source
        self.dataplane = source.dataplane
        self.mode = TicketMode(mode)
        self.uid: str = info.uid
        #: a fresh sequence number for one mutating request (thread-safe)
        self.next_seq: Callable[[], int] = self.dataplane.next_seq
        self._lock = threading.Lock()
        self._avoid: dict[str, float] = {}   # server id -> monotonic time until which reads avoid it
        self._gone = ""                      # why every operation is refused (another incarnation)
        self._adopt(info, ticket)

    def _adopt(self, info: Any, ticket: Any) -> None:
        """Take a description of the region from the controller (under the lock, or
        before the route is shared); one of another incarnation ends the route."""
        if info.uid != self.uid:
            self._gone = (f"region {info.name} (uid {self.uid}) was deleted; the region of that name "
                          f"now is another one (uid {info.uid}): open it again to use it")
            raise RegionNotFound(self._gone)
        self.name: str = info.name
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
        self.dataplane.learn((*self.extents, *self.copies))   # where the servers listen now
        self._readers = tuple(self._nearest(slot) for slot in range(len(self.extents)))
        #: the ticket token every request carries, and its expiry (unix seconds)
        self.ticket: str = ticket.token
        self.expires_at: float = ticket.expires_at

    def _nearest(self, slot: int) -> ExtentPlace:
        """The copy of ``slot`` reads go to: a live copy on this host (shm), else the
        primary, else a live backup; servers that failed lately come last."""
        primary = self.extents[slot]
        if self.replicas == 1:
            return primary
        backups = [c for c in self.copies if c.index == slot and c.role == ReplicaRole.BACKUP]
        here = self.dataplane.here
        avoid = self._avoid
        now = time.monotonic()

        def rank(p: ExtentPlace) -> tuple[int, int, int]:
            failed = avoid.get(p.server_id, 0.0) > now
            local = p.host_id == here and any(u.startswith("shm://") for u in p.endpoints)
            return (int(failed or p.server_state == "down"), int(not local), int(p is not primary))
        return min([primary, *backups], key=rank)

    # -- checks and planning ---------------------------------------------------------
    def check_writable(self) -> None:
        """ReadOnly unless the region was opened for writing."""
        if not self.mode.writes:
            raise ReadOnly(f"region {self.name} was opened read-only")

    def word(self, offset: int) -> tuple[int, int]:
        """The layout slot and extent offset of the int64 word at byte ``offset``."""
        if offset % 8:
            raise Misaligned(f"atomic word offset {offset} is not 8-byte aligned")
        pieces = self.layout.map(offset, 8)
        if len(pieces) != 1:
            raise Misaligned(f"word at {offset} straddles two extents")
        return pieces[0].extent, pieces[0].extent_offset

    def chunks(self, offset: int, length: int, align: int = 1) -> list[Run]:
        """The requests of ``length`` bytes at ``offset``: runs of one extent each, of at
        most the client's ``chunk_bytes`` (cut at multiples of ``align``)."""
        return split_runs(self.layout.runs(offset, length), self.source.chunk_bytes, align)

    # -- slot -> session -------------------------------------------------------------
    def session(self, place: ExtentPlace) -> Session:
        """The data session of ``place``'s server (the client's; borrowed)."""
        return self.dataplane.session(place)

    def coordination(self, place: ExtentPlace) -> Session:
        """The coordination (tcp) session of ``place``'s server (the client's; borrowed)."""
        return self.dataplane.coordination(place)

    def target(self, slot: int, mutate: bool) -> tuple[Session, ExtentPlace]:
        """The session and copy a request on layout slot ``slot`` goes to now: a
        replicated region's mutations go to the primary's tcp plane, its reads to the
        nearest live copy; an unreplicated region's requests to the slot's extent over
        the transport chosen for its server."""
        if self.replicas == 1 and not self.copies:
            place = self.extents[slot]
            return self.dataplane.session(place), place
        if mutate:
            place = self.extents[slot]
            return self.dataplane.coordination(place), place
        place = self._readers[slot]
        return self.dataplane.session(place), place

    def transports(self) -> dict[str, str]:
        """The transport used for each server (opening sessions); for a replicated
        region, the one its reads use (mutations go to the primary's tcp plane)."""
        return {p.server_id: self.session(p).scheme for p in (*self.extents, *self.copies)
                if p.role != ReplicaRole.SYNCING}

    def request(self, slot: int, mutate: bool, send: Callable[[Session, ExtentPlace], T]) -> T:
        """Send one request on ``slot`` to the copy :meth:`target` names when it runs."""
        session, place = self.target(slot, mutate)
        try:
            return send(session, place)
        except (errors.ServerUnavailable, errors.ExtentNotFound) as exc:
            failed_at(exc, place)
            if isinstance(exc, errors.ServerUnavailable):
                self._failed(place)
            raise

    def stream(self, slot: int, rdma: bool = True) -> tuple[Reducer | None, ExtentPlace]:
        """The collective stream of ``slot``'s server (borrowed: the rdma session's, unless
        not ``rdma``, else the tcp session's; None over TLS) and the copy it reaches now."""
        place = self.extents[slot]
        session = self.session(place) if rdma else None
        if session is not None and session.scheme == "rdma":
            return session.reductions(), place
        return self.dataplane.coordination(place).reductions(), place

    def coordinate(self, slot: int, send: Callable[[Session, ExtentPlace], T]) -> T:
        """Run one coordination request (a wait, a lock, a barrier's arrival, a
        collective's push or pull) on ``slot`` through its primary server's tcp session,
        as an operation of its own (:meth:`run`): the copy is looked up on every
        attempt, so a retry after a failover reaches the new primary."""
        def attempt() -> T:
            place = self.extents[slot]
            try:
                return send(self.dataplane.coordination(place), place)
            except (errors.ServerUnavailable, errors.ExtentNotFound) as exc:
                failed_at(exc, place)
                raise
        return self.run(attempt)

    def _failed(self, place: ExtentPlace) -> None:
        """Reads of a replicated region avoid ``place``'s server for a while."""
        if self.replicas > 1:
            with self._lock:
                self._avoid[place.server_id] = time.monotonic() + AVOID_SECONDS
                self._readers = tuple(self._nearest(slot) for slot in range(len(self.extents)))

    # -- running operations ----------------------------------------------------------
    def run_all(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run the requests of one operation in parallel (:meth:`DataPlane.run`) under
        :meth:`run`; their results in order."""
        dataplane = self.dataplane
        result: list[Any] = self.run(lambda: dataplane.run(tasks))
        return result

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn`` on the client's async pool (the ``*_async`` forms)."""
        return self.dataplane.submit(fn, *args, **kwargs)

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` under a fresh ticket; after TicketExpired, renew the ticket and run
        it again (with backoff, for up to :data:`REFRESH_TIMEOUT` seconds); a replicated
        region also fails over (:meth:`_failing_over`). ``fn`` must send the same
        numbered requests each time it runs (plan them outside ``fn``). RegionNotFound
        at once once the region's name belongs to another incarnation."""
        if self._gone:
            raise RegionNotFound(self._gone)
        if time.time() > self.expires_at - REFRESH_MARGIN:
            self.refresh()
        explained = False
        try:
            if self.replicas > 1:
                return self._failing_over(fn)
            try:
                return self._retrying_once(fn)
            except (errors.ServerUnavailable, errors.ExtentNotFound) as exc:
                before = self._places()
                explained = True
                self._explain(exc)
                if getattr(exc, "outcome_unknown", False):   # an unnumbered one-sided atomic
                    raise
                now = self._places()
                moved = now != before or _left(exc, now)
                if not isinstance(exc, errors.NotPrimary) and not moved and not self.copies:
                    raise      # the same server holds it and nothing moves: the server failed
                # a refusal (NotPrimary) applied nothing; a switch under way ends soon
                log.info("region %s: moved or being moved (%s); running the operation again", self.name, exc)
            explained = False
            return self._failing_over(fn)
        except (errors.ServerUnavailable, errors.ExtentNotFound) as exc:
            if not explained:
                self._explain(exc)
            raise

    def _places(self) -> tuple[tuple[int, str], ...]:
        """Each slot's extent and server: what a move changes."""
        return tuple((p.extent_id, p.server_id) for p in self.extents)

    def refresh(self) -> None:
        """Open the region again: a fresh ticket and the current server list.
        RegionNotFound when its name now belongs to another incarnation."""
        info, ticket = self.source.open_info(self.name, self.mode)
        with self._lock:
            self._adopt(info, ticket)

    def _retrying_once(self, fn: Callable[[], T]) -> T:
        try:                  # the common case first: no retry policy built per operation
            return fn()
        except TicketExpired:
            pass

        def attempt() -> T:
            self.refresh()
            return fn()
        retry = Retry(on=(TicketExpired,), timeout=REFRESH_TIMEOUT, backoff=Backoff(first=0.01, cap=0.2))
        result: T = retry(attempt, what=f"region {self.name}")
        return result

    def _failing_over(self, fn: Callable[[], T]) -> T:
        """:meth:`_retrying_once` for a replicated region: also after a server that did
        not answer, a copy that is no longer the primary (NotPrimary) or an extent a
        server no longer holds (a copy the controller replaced), open the region again and
        run ``fn`` again, for up to :data:`FAILOVER_TIMEOUT` seconds. The controller
        being unreachable meanwhile is waited out the same way; a region deleted or lost
        meanwhile raises from the reopening."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self.refresh()
            return fn()
        retry = Retry(on=(TicketExpired, errors.Unavailable, errors.ExtentNotFound),
                      timeout=FAILOVER_TIMEOUT, backoff=move_backoff())
        result: T = retry(attempt, what=f"region {self.name}")
        return result

    def _explain(self, exc: errors.SMBError) -> None:
        """After a server was unreachable or no longer held an extent, ask the controller
        what became of the region: a region that is ``lost`` (its server came back
        without its memory) raises :class:`~smb_protocol.errors.RegionLost` instead,
        chained to ``exc``; one whose name now belongs to another incarnation, or that
        was deleted, raises RegionNotFound (and so does every later operation), even
        while its server is unreachable. The operation is not run again (part of it may
        have taken effect)."""
        try:
            info, ticket = self.source.open_info(self.name, self.mode, reconnect_timeout=EXPLAIN_PATIENCE)
        except errors.RegionLost as why:
            raise why from exc
        except RegionNotFound as why:
            with self._lock:
                self._gone = f"region {self.name} (uid {self.uid}) was deleted ({why})"
            raise RegionNotFound(self._gone) from exc
        except errors.SMBError:
            log.debug("region %s: controller not reachable to explain %r", self.name, exc)
            return
        with self._lock:
            try:
                self._adopt(info, ticket)   # the servers' current endpoints for the next operation
            except RegionNotFound as why:
                raise why from exc
