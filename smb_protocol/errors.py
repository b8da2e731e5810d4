"""The exception tree of Soft Memory Box.

Every error the client raises derives from :class:`SMBError`. The tree is shaped so
that a retry policy is a tuple of base classes, e.g. ``(Unavailable, TicketExpired)``.

Servers report errors by *name* (gRPC trailing metadata ``smb-error`` on the control
plane, a status code on the TCP data plane); :func:`error_class` maps a name back to a
class, so both sides share one vocabulary. Each class declares its data-plane
``status`` and (where it introduces one) its gRPC ``grpc_code``; every lookup table
below is built from the tree, none is kept by hand.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar


class Status(enum.IntEnum):
    """Data-plane status codes (one byte on the wire), one per error class.

    Each :class:`SMBError` subclass names its own in ``status``; the values are fixed
    (peers of other versions read them), so new classes take new numbers.
    """

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
    ERROR = 13
    UNAVAILABLE = 14
    CONTROLLER_UNAVAILABLE = 15
    SERVER_UNAVAILABLE = 16
    TIMEOUT = 17
    BARRIER_TIMEOUT = 18
    NOT_FOUND = 19
    REGION_NOT_FOUND = 20
    SERVER_NOT_FOUND = 21
    REGION_EXISTS = 22
    UNAUTHENTICATED = 23
    SERVER_BUSY = 24
    CONTROLLER_BUSY = 25
    REGION_LOST = 26
    LOCK_NOT_HELD = 27
    NOT_PRIMARY = 28
    ROUND_MISMATCH = 29
    CLOSED = 30
    VERSION_GONE = 31


class SMBError(Exception):
    """Base class of every Soft Memory Box error."""

    status: ClassVar[Status] = Status.ERROR
    grpc_code: ClassVar[str] = "INTERNAL"


class Unavailable(SMBError):
    """A controller or memory server cannot be reached (down, killed, link lost)."""

    status: ClassVar[Status] = Status.UNAVAILABLE
    grpc_code: ClassVar[str] = "UNAVAILABLE"


class ControllerUnavailable(Unavailable):
    """The controller did not answer."""

    status: ClassVar[Status] = Status.CONTROLLER_UNAVAILABLE


class ControllerBusy(ControllerUnavailable):
    """The controller refused a call for load: too many callers wait in barriers, or
    client calls hold every thread it keeps for them (heartbeats always get theirs).
    Retried like ControllerUnavailable; retry later or raise ``barrier_waits_max``."""

    status: ClassVar[Status] = Status.CONTROLLER_BUSY


class ServerUnavailable(Unavailable):
    """A memory server did not answer or dropped the connection."""

    status: ClassVar[Status] = Status.SERVER_UNAVAILABLE


class NotPrimary(ServerUnavailable):
    """A mutation of a replicated region reached a copy that is not (or no longer) the
    primary of its replica set: open the region again for the current primary and send
    the same numbered request there (the region does this by itself)."""

    status: ClassVar[Status] = Status.NOT_PRIMARY


class ServerBusy(ServerUnavailable):
    """A memory server refused a new data-plane connection: it is full, this client's
    address holds its per-peer share, or the server ran out of file descriptors. The
    message names the limit; retry later, close idle connections, or raise the limit."""

    status: ClassVar[Status] = Status.SERVER_BUSY


class Timeout(SMBError):
    """An operation did not finish within its deadline."""

    status: ClassVar[Status] = Status.TIMEOUT
    grpc_code: ClassVar[str] = "DEADLINE_EXCEEDED"


class BarrierTimeout(Timeout):
    """Not every party reached the barrier in time. ``arrived`` and ``parties`` count
    them, ``missing`` lists the ranks that did not come (each None where unknown); the
    controller sends them beside the message (:mod:`smb_protocol.waits`)."""

    status: ClassVar[Status] = Status.BARRIER_TIMEOUT

    def __init__(self, message: str = "", *, arrived: int | None = None, parties: int | None = None,
                 missing: Sequence[int] | None = None) -> None:
        super().__init__(message)
        self.arrived = arrived
        self.parties = parties
        self.missing = None if missing is None else list(missing)


class NotFound(SMBError):
    """Something named does not exist."""

    status: ClassVar[Status] = Status.NOT_FOUND
    grpc_code: ClassVar[str] = "NOT_FOUND"


class RegionNotFound(NotFound):
    """No region of that name (or it was deleted)."""

    status: ClassVar[Status] = Status.REGION_NOT_FOUND


class ExtentNotFound(RegionNotFound):
    """A memory server no longer holds the extent: its region was deleted or lost."""

    status: ClassVar[Status] = Status.EXTENT_NOT_FOUND


class RegionLost(SMBError):
    """Some byte of the region has no live copy: a memory server that held one of its
    extents came back without it (restarted without its memory). The message names the
    servers; the data is gone, delete the region and create it again."""

    status: ClassVar[Status] = Status.REGION_LOST


class ServerNotFound(NotFound):
    """No memory server with that id."""

    status: ClassVar[Status] = Status.SERVER_NOT_FOUND


class RegionExists(SMBError):
    """A region of that name already exists."""

    status: ClassVar[Status] = Status.REGION_EXISTS
    grpc_code: ClassVar[str] = "ALREADY_EXISTS"


class OutOfMemory(SMBError):
    """Not enough free capacity on the memory servers for the request."""

    status: ClassVar[Status] = Status.OUT_OF_MEMORY
    grpc_code: ClassVar[str] = "RESOURCE_EXHAUSTED"


class PermissionDenied(SMBError):
    """The caller may not do this."""

    status: ClassVar[Status] = Status.PERMISSION_DENIED
    grpc_code: ClassVar[str] = "PERMISSION_DENIED"


class AuthenticationError(PermissionDenied):
    """Missing or wrong bearer token."""

    status: ClassVar[Status] = Status.UNAUTHENTICATED
    grpc_code: ClassVar[str] = "UNAUTHENTICATED"


class InvalidTicket(PermissionDenied):
    """A ticket that is malformed, forged, or names other extents."""

    status: ClassVar[Status] = Status.INVALID_TICKET


class TicketExpired(PermissionDenied):
    """A ticket past its expiry; open the region again for a fresh one."""

    status: ClassVar[Status] = Status.TICKET_EXPIRED


class ReadOnly(PermissionDenied):
    """A write through a read-only ticket."""

    status: ClassVar[Status] = Status.READ_ONLY


class InvalidArgument(SMBError, ValueError):
    """A malformed request."""

    status: ClassVar[Status] = Status.INVALID_ARGUMENT
    grpc_code: ClassVar[str] = "INVALID_ARGUMENT"


class OutOfRange(InvalidArgument):
    """Offset and length do not lie inside the region or extent."""

    status: ClassVar[Status] = Status.OUT_OF_RANGE
    grpc_code: ClassVar[str] = "OUT_OF_RANGE"


class Misaligned(InvalidArgument):
    """An offset or length that is not a multiple of the element size (8 for atomics)."""

    status: ClassVar[Status] = Status.MISALIGNED


class DtypeError(InvalidArgument, TypeError):
    """An unsupported or mismatching element type."""

    status: ClassVar[Status] = Status.DTYPE


class LockNotHeld(SMBError):
    """A lock released or renewed by a holder that does not hold it: its lease ran out
    (and another holder may have taken it), or it was never taken."""

    status: ClassVar[Status] = Status.LOCK_NOT_HELD
    grpc_code: ClassVar[str] = "FAILED_PRECONDITION"


class RoundMismatch(SMBError):
    """A collective's push or pull that does not belong to the round its chunk is in, or
    a party beyond the collective's ``parties``: a party that opened the collective after
    the others went past its first round, one that came back after a restart, or a
    replayed request. The memory server refuses it, so that nothing is added into another
    round's sum; the collective cannot go on for this party. Every party makes a new
    collective (a new name) to start over."""

    status: ClassVar[Status] = Status.ROUND_MISMATCH


class Closed(SMBError):
    """An object used after its ``close()``: a client, its data plane, a process group.
    A mistake in the caller, not a passing failure: it is no :class:`Unavailable`, so a
    retry policy of base classes never retries it. Open a new one instead."""

    status: ClassVar[Status] = Status.CLOSED


class VersionGone(SMBError):
    """A published version that is no longer held: the publisher reused its buffer
    (it keeps a fixed number of versions) before or while it was read. What was read is
    not that version; read the newest (a subscriber's ``read`` does so by itself unless
    a version was asked for), or keep more versions."""

    status: ClassVar[Status] = Status.VERSION_GONE


class ProtocolError(SMBError):
    """A peer spoke the wire protocol wrongly."""

    status: ClassVar[Status] = Status.PROTOCOL


class ServerError(SMBError):
    """An unexpected failure inside a server."""

    status: ClassVar[Status] = Status.INTERNAL
    grpc_code: ClassVar[str] = "INTERNAL"


def _walk(cls: type[SMBError]) -> list[type[SMBError]]:
    """``cls`` and its subclasses, parents before children (definition order)."""
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_walk(sub))
    return out


def _tables() -> tuple[dict[str, type[SMBError]], dict[Status, type[SMBError]], dict[str, type[SMBError]]]:
    """By name, by data-plane status and by gRPC code name (the most general class that
    declares the code; the root is left out so that an unnamed INTERNAL is a
    :class:`ServerError`). Raises TypeError when two classes share a name or status."""
    by_name: dict[str, type[SMBError]] = {}
    by_status: dict[Status, type[SMBError]] = {}
    by_code: dict[str, type[SMBError]] = {}
    for cls in _walk(SMBError):
        if cls.__module__ != __name__:
            continue  # subclasses made elsewhere (tests, callers) travel as their base
        own = vars(cls)
        if cls.__name__ in by_name or "status" not in own or own["status"] in by_status:
            raise TypeError(f"{cls.__name__}: every error class needs its own name and status")
        by_name[cls.__name__] = by_status[cls.status] = cls
        if "grpc_code" in own and cls is not SMBError:
            by_code.setdefault(cls.grpc_code, cls)
    return by_name, by_status, by_code


_BY_NAME, _BY_STATUS, BY_GRPC_CODE = _tables()


def error_classes() -> list[type[SMBError]]:
    """Every error class of this module, parents before children."""
    return list(_BY_NAME.values())


def error_class(name: str) -> type[SMBError]:
    """The exception class called ``name``; :class:`ServerError` when unknown."""
    return _BY_NAME.get(name, ServerError)


def wire_class(exc: BaseException) -> type[SMBError]:
    """The class ``exc`` travels as: its own, or its nearest base defined here
    (:class:`ServerError` for anything that is not an :class:`SMBError`)."""
    for cls in type(exc).__mro__:
        if _BY_NAME.get(cls.__name__) is cls:
            return cls
    return ServerError


def status_error(status: int, message: str) -> SMBError:
    """The exception for a data-plane status code and message."""
    try:
        cls = _BY_STATUS[Status(status)]
    except (ValueError, KeyError):
        cls = ServerError
    return cls(message)


def error_status(exc: BaseException) -> Status:
    """The data-plane status code for an exception (its nearest known base class)."""
    return wire_class(exc).status


# a literal list, so that type checkers see ``smb_client.RegionNotFound``; a unit test
# keeps it equal to the tree
__all__ = [
    "SMBError", "Unavailable", "ControllerUnavailable", "ControllerBusy", "ServerUnavailable",
    "ServerBusy", "NotPrimary",
    "Timeout",
    "BarrierTimeout", "NotFound", "RegionNotFound", "ExtentNotFound", "ServerNotFound",
    "RegionExists", "RegionLost", "OutOfMemory", "PermissionDenied", "AuthenticationError", "InvalidTicket",
    "TicketExpired", "ReadOnly", "InvalidArgument", "OutOfRange", "Misaligned", "DtypeError",
    "LockNotHeld", "RoundMismatch", "Closed", "VersionGone", "ProtocolError", "ServerError", "Status", "error_class",
    "error_classes", "error_status", "status_error", "wire_class",
]
