"""The exception tree of Soft Memory Box.

Every error the client raises derives from :class:`SMBError`. The tree is shaped so
that a retry policy is a tuple of base classes, e.g. ``(Unavailable, TicketExpired)``.

Servers report errors by *name* (gRPC trailing metadata ``smb-error`` on the control
plane, a status code on the TCP data plane); :func:`error_class` maps a name back to a
class, so both sides share one vocabulary.
"""
from __future__ import annotations

import enum


class SMBError(Exception):
    """Base class of every Soft Memory Box error."""


class Unavailable(SMBError):
    """A controller or memory server cannot be reached (down, killed, link lost)."""


class ControllerUnavailable(Unavailable):
    """The controller did not answer."""


class ServerUnavailable(Unavailable):
    """A memory server did not answer or dropped the connection."""


class Timeout(SMBError):
    """An operation did not finish within its deadline."""


class BarrierTimeout(Timeout):
    """Not every party reached the barrier in time."""


class NotFound(SMBError):
    """Something named does not exist."""


class RegionNotFound(NotFound):
    """No region of that name (or it was deleted)."""


class ExtentNotFound(RegionNotFound):
    """A memory server no longer holds the extent: its region was deleted or lost."""


class ServerNotFound(NotFound):
    """No memory server with that id."""


class RegionExists(SMBError):
    """A region of that name already exists."""


class OutOfMemory(SMBError):
    """Not enough free capacity on the memory servers for the request."""


class PermissionDenied(SMBError):
    """The caller may not do this."""


class AuthenticationError(PermissionDenied):
    """Missing or wrong bearer token."""


class InvalidTicket(PermissionDenied):
    """A ticket that is malformed, forged, or names other extents."""


class TicketExpired(PermissionDenied):
    """A ticket past its expiry; open the region again for a fresh one."""


class ReadOnly(PermissionDenied):
    """A write through a read-only ticket."""


class InvalidArgument(SMBError, ValueError):
    """A malformed request."""


class OutOfRange(InvalidArgument):
    """Offset and length do not lie inside the region or extent."""


class Misaligned(InvalidArgument):
    """An offset or length that is not a multiple of the element size (8 for atomics)."""


class DtypeError(InvalidArgument, TypeError):
    """An unsupported or mismatching element type."""


class ProtocolError(SMBError):
    """A peer spoke the wire protocol wrongly."""


class ServerError(SMBError):
    """An unexpected failure inside a server."""


_CLASSES = {cls.__name__: cls for cls in (
    SMBError, Unavailable, ControllerUnavailable, ServerUnavailable, Timeout,
    BarrierTimeout, NotFound, RegionNotFound, ExtentNotFound, ServerNotFound,
    RegionExists, OutOfMemory, PermissionDenied, AuthenticationError, InvalidTicket,
    TicketExpired, ReadOnly, InvalidArgument, OutOfRange, Misaligned, DtypeError,
    ProtocolError, ServerError,
)}


def error_class(name: str) -> type[SMBError]:
    """The exception class called ``name``; :class:`ServerError` when unknown."""
    return _CLASSES.get(name, ServerError)


class Status(enum.IntEnum):
    """Data-plane status codes (one byte on the wire), one per error class."""

    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    MISALIGNED = 3
    DTYPE = 4
    PERMISSION_DENIED = 5
    INVALID_TICKET = 6
    TICKET_EXPIRED = 7
    READ_ONLY = 8
    EXTENT_NOT_FOUND = 9
    PROTOCOL = 10
    INTERNAL = 11
    OUT_OF_MEMORY = 12


_STATUS_CLASS: dict[Status, type[SMBError]] = {
    Status.INVALID_ARGUMENT: InvalidArgument,
    Status.OUT_OF_RANGE: OutOfRange,
    Status.MISALIGNED: Misaligned,
    Status.DTYPE: DtypeError,
    Status.PERMISSION_DENIED: PermissionDenied,
    Status.INVALID_TICKET: InvalidTicket,
    Status.TICKET_EXPIRED: TicketExpired,
    Status.READ_ONLY: ReadOnly,
    Status.EXTENT_NOT_FOUND: ExtentNotFound,
    Status.PROTOCOL: ProtocolError,
    Status.INTERNAL: ServerError,
    Status.OUT_OF_MEMORY: OutOfMemory,
}
_CLASS_STATUS = {cls: st for st, cls in _STATUS_CLASS.items()}


def status_error(status: int, message: str) -> SMBError:
    """The exception for a data-plane status code and message."""
    try:
        cls = _STATUS_CLASS[Status(status)]
    except (ValueError, KeyError):
        cls = ServerError
    return cls(message)


def error_status(exc: BaseException) -> Status:
    """The data-plane status code for an exception (its nearest known base class)."""
    for cls in type(exc).__mro__:
        if cls in _CLASS_STATUS:
            return _CLASS_STATUS[cls]
    return Status.INTERNAL
