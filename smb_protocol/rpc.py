"""gRPC plumbing shared by the client and the servers: channels, auth metadata, errors.

Servers report a typed error by name in the trailing metadata key ``smb-error`` (and
a barrier timeout's counts beside it, :mod:`smb_protocol.waits`); :func:`call` turns
any :class:`grpc.RpcError` back into that class with those fields (or, lacking the
name, into the closest class for the status code).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from smb_protocol import errors, tracing, waits

from .tls import TLSConfig, is_trust_failure, untrusted

log = logging.getLogger(__name__)

ERROR_KEY = "smb-error"
MAX_MESSAGE_BYTES = 64 << 20  # the largest gRPC message either side sends or accepts
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    ("grpc.enable_retries", 0),
    # a restarted controller is found again within a fraction of a second, not after
    # gRPC's default exponential backoff (up to two minutes). "min_reconnect_backoff" is
    # left alone on purpose: gRPC uses it as the deadline of one connection attempt
    # (default 20 s), and a small value fails every handshake on a slow or loaded host.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]



def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code ``exc`` travels with (declared on its class or a base)."""
    return grpc.StatusCode[errors.wire_class(exc).grpc_code]


def code_class(code: grpc.StatusCode) -> type[errors.SMBError]:
    """The class for a failed call that named none: the most general one declaring
    ``code``; :class:`~smb_protocol.errors.ServerError` for codes no class declares."""
    return errors.BY_GRPC_CODE.get(code.name, errors.ServerError)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """A channel to ``host:port``: over TLS when ``tls`` (default: the ``SMB_TLS_*``
    environment, see :mod:`smb_protocol.tls`) names a CA, else in the clear. While
    tracing is on (when the channel is made), calls made inside a trace are spans of
    it and carry its context (:class:`TraceInterceptor`)."""
    tls = TLSConfig.from_env() if tls is None else tls
    if not tls.enabled:
        made = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        tls.client_context()   # checks the files: InvalidArgument naming them, before any call
        ca, cert, key = tls.read()
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
        made = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(made, TraceInterceptor()) if tracing.enabled() else made


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


if TYPE_CHECKING:  # generic in the type stubs only; grpc's own class takes no parameters
    _UnaryInterceptor = grpc.UnaryUnaryClientInterceptor[Any, Any]
else:
    _UnaryInterceptor = grpc.UnaryUnaryClientInterceptor


class TraceInterceptor(_UnaryInterceptor):
    """A unary call made inside a trace becomes a client span (named for the method,
    ``smb.v1.Controller/OpenRegion``) whose ``traceparent`` travels in the call's
    metadata; a call outside any trace (heartbeats) passes untouched."""

    def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any], details: Any, request: Any) -> Any:
        span = tracing.client_span(details.method.lstrip("/"))
        if span is None:
            return continuation(details, request)
        parent = tracing.traceparent(span)
        metadata = [*(details.metadata or ()), *([(tracing.TRACEPARENT, parent.decode())] if parent else [])]
        try:
            outcome = continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                                details.wait_for_ready, details.compression), request)
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        outcome.add_done_callback(lambda done: tracing.end(span, done.exception()))
        return outcome


def translate(exc: grpc.RpcError, unavailable: type[errors.SMBError] = errors.Unavailable) -> errors.SMBError:
    """The typed exception for a failed call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    trailing: list[tuple[str, str]] = []
    try:
        trailing = [(str(item.key), str(item.value)) for item in exc.trailing_metadata() or ()]
    except Exception:  # a channel-level failure has no trailing metadata
        pass
    name = dict(trailing).get(ERROR_KEY)
    if name:
        typed = errors.error_class(name)(detail or code.name)
        waits.read_metadata(typed, trailing)
        return typed
    if code == grpc.StatusCode.UNAVAILABLE and is_trust_failure(detail or ""):
        return untrusted("gRPC call", detail or "")
    cls = unavailable if code == grpc.StatusCode.UNAVAILABLE else code_class(code)
    return cls(detail or code.name)


def call(method: Callable[..., Any], request: Any, token: str | None, timeout: float | None,
         unavailable: type[errors.SMBError] = errors.Unavailable) -> Any:
    """Invoke a unary stub method with auth metadata; raise typed errors."""
    try:
        return method(request, metadata=auth_metadata(token), timeout=timeout)
    except grpc.RpcError as exc:
        raise translate(exc, unavailable) from None
