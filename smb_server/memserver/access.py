"""Who may touch which extent: the ticket checks shared by every data plane.

A data-plane connection may carry several tickets (one per region its client uses on
this server). :class:`TicketBook` keeps them by the extent ids they name, so a request
is authorized against the ticket that names its extent, never against another region's.
"""
from __future__ import annotations

import logging
import threading
import time

from smb_protocol.errors import ExtentNotFound, InvalidTicket, ReadOnly, TicketExpired
from smb_protocol.tickets import Ticket, TicketMode

from .arena import Arena, Extent

log = logging.getLogger(__name__)


def check_access(ticket: Ticket, arena: Arena, extent_id: int, write: bool) -> Extent:
    """The extent ``ticket`` may use; raises TicketExpired, InvalidTicket, ReadOnly, ExtentNotFound."""
    if ticket.expires_at < time.time():
        raise TicketExpired("ticket expired; open the region again for a fresh one")
    if extent_id not in ticket.extent_ids:
        raise InvalidTicket(f"the ticket does not name extent {extent_id}")
    if not ticket.allows(extent_id, write=write):
        raise ReadOnly(f"extent {extent_id}: write through a read-only ticket")
    extent = arena.get(extent_id)
    if extent.region_uid != ticket.region_uid:
        raise ExtentNotFound(f"extent {extent_id} does not belong to region {ticket.region_uid!r} "
                             f"(the region was deleted)")
    return extent


class TicketBook:
    """The verified tickets of one connection, by the extent ids they name and their mode.

    A later ticket of the same mode naming an extent replaces the earlier one for that
    extent (a renewed ticket); tickets of other modes stay beside it, so a client that
    holds a region both read-write and read-only on one connection keeps writing through
    the first after using the second. A request is checked against a ticket naming its
    extent that allows it (the one that expires last, where several do). Thread-safe.
    """

    def __init__(self) -> None:
        self._by_extent: dict[int, dict[TicketMode, Ticket]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._by_extent)

    def add(self, ticket: Ticket) -> None:
        with self._lock:
            for extent_id in ticket.extent_ids:
                self._by_extent.setdefault(extent_id, {})[ticket.mode] = ticket

    def get(self, extent_id: int, mode: TicketMode | None = None) -> Ticket | None:
        """The ticket of ``mode`` presented for ``extent_id`` (None: the last presented
        of any mode), if any."""
        with self._lock:
            held = self._by_extent.get(extent_id, {})
            if mode is not None:
                return held.get(mode)
            return next(reversed(held.values()), None)

    def writable(self, extent_id: int) -> Ticket | None:
        """The ticket presented for ``extent_id`` that allows writing it and expires last."""
        with self._lock:
            held = [t for t in self._by_extent.get(extent_id, {}).values() if t.allows(extent_id, write=True)]
        return max(held, key=lambda t: t.expires_at, default=None)

    def check(self, arena: Arena, extent_id: int, write: bool) -> Extent:
        """The extent, if a ticket presented for it allows the access (see
        :func:`check_access`); InvalidTicket when no ticket names it."""
        with self._lock:
            held = list(self._by_extent.get(extent_id, {}).values())
        if not held:
            raise InvalidTicket(f"no ticket presented on this connection names extent {extent_id}")
        if len(held) == 1:   # the usual case: one ticket names the extent
            return check_access(held[0], arena, extent_id, write)
        fitting = [t for t in held if t.allows(extent_id, write=write)]
        ticket = max(fitting, key=lambda t: t.expires_at) if fitting else held[-1]
        return check_access(ticket, arena, extent_id, write)
