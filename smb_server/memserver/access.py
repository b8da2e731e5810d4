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
from smb_protocol.tickets import Ticket

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
    """The verified tickets of one connection, by the extent ids they name.

    A later ticket naming an extent replaces the earlier one for that extent (a renewed
    ticket, or the region opened again in another mode). Thread-safe.
    """

    def __init__(self) -> None:
        self._by_extent: dict[int, Ticket] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._by_extent)

    def add(self, ticket: Ticket) -> None:
        with self._lock:
            for extent_id in ticket.extent_ids:
                self._by_extent[extent_id] = ticket

    def get(self, extent_id: int) -> Ticket | None:
        """The ticket presented for ``extent_id``, if any."""
        with self._lock:
            return self._by_extent.get(extent_id)

    def check(self, arena: Arena, extent_id: int, write: bool) -> Extent:
        """The extent, if the ticket presented for it allows the access (see
        :func:`check_access`); InvalidTicket when no ticket names it."""
        with self._lock:
            ticket = self._by_extent.get(extent_id)
        if ticket is None:
            raise InvalidTicket(f"no ticket presented on this connection names extent {extent_id}")
        return check_access(ticket, arena, extent_id, write)
