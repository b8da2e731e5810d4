"""gRPC plumbing shared by the client and the servers: channels, auth metadata, errors.

Servers report a typed error by name in the trailing metadata key ``smb-error``;
:func:`call` turns any :class:`grpc.RpcError` back into that class (or, lacking the
name, into the closest class for the status code).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import grpc

from . import errors

log = logging.getLogger(__name__)

ERROR_KEY = "smb-error"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
    # a restarted controller is found again within a fraction of a second, not after
    # gRPC's default exponential backoff (up to two minutes). "min_reconnect_backoff" is
    # left alone on purpose: gRPC uses it as the deadline of one connection attempt
    # (default 20 s), and a small value fails every handshake on a slow or loaded host.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_CODE_CLASS: dict[grpc.StatusCode, type[errors.SMBError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.RegionExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.OutOfMemory,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthenticationError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.OutOfRange,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Timeout,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: errors.InvalidArgument,
}
_CLASS_CODE: list[tuple[type[errors.SMBError], grpc.StatusCode]] = [
    (errors.RegionNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.RegionExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.OutOfMemory, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _CLASS_CODE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel(address: str) -> grpc.Channel:
    """An insecure channel to ``host:port`` (TLS arrives with certificates in config)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def translate(exc: grpc.RpcError, unavailable: type[errors.SMBError] = errors.Unavailable) -> errors.SMBError:
    """The typed exception for a failed call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    name = None
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_KEY:
                name = value
    except Exception:  # a channel-level failure has no trailing metadata
        pass
    if name:
        cls = errors.error_class(name)
    elif code == grpc.StatusCode.UNAVAILABLE:
        cls = unavailable
    else:
        cls = _CODE_CLASS.get(code, errors.ServerError)
    return cls(detail or code.name)


def call(method: Callable[..., Any], request: Any, token: str | None, timeout: float | None,
         unavailable: type[errors.SMBError] = errors.Unavailable) -> Any:
    """Invoke a unary stub method with auth metadata; raise typed errors."""
    try:
        return method(request, metadata=auth_metadata(token), timeout=timeout)
    except grpc.RpcError as exc:
        raise translate(exc, unavailable) from None
