"""Server-side gRPC helpers: bearer-token auth and typed errors."""
from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc

from smb_client import errors
from smb_client.rpc import ERROR_KEY, MESSAGE_SIZE_OPTIONS, status_code_for

log = logging.getLogger(__name__)


class BearerAuth(grpc.ServerInterceptor):
    """Refuse calls without ``authorization: Bearer <token>``, except ``exempt`` methods.

    ``exempt`` holds full method names (``/smb.v1.MemoryServer/ReserveExtent``) whose
    handlers check a ticket instead. With ``token`` empty, every call is allowed.
    """

    def __init__(self, token: str, exempt: Iterable[str] = ()) -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self._exempt = frozenset(exempt)

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.set_trailing_metadata(((ERROR_KEY, errors.AuthenticationError.__name__),))
            context.abort(status_code_for(errors.AuthenticationError()),
                          "missing or wrong bearer token (set SMB_TOKEN or pass token=...)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if not self._expected or details.method in self._exempt:
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(details)
        return self._deny


def abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    """End the call with the status code and typed name of ``exc``."""
    name = errors.wire_class(exc).__name__
    context.set_trailing_metadata(((ERROR_KEY, name),))
    context.abort(status_code_for(exc), str(exc) or name)


def typed_errors(method: Callable) -> Callable:
    """Decorator for servicer methods: SMBError and ValueError become typed gRPC errors."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except errors.SMBError as exc:
            abort(context, exc)
        except Exception as exc:  # keep serving; report the failure
            if type(exc) is Exception and not exc.args:  # grpc's own context.abort()
                raise
            log.exception("%s failed", method.__name__)
            abort(context, errors.ServerError(f"{method.__name__}: {exc}"))

    return wrapper


def make_server(max_workers: int = 32, interceptors: Iterable[grpc.ServerInterceptor] = ()) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       interceptors=list(interceptors),
                       options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)])
