"""Server spans for gRPC calls that arrive inside a trace, as a server interceptor.

A unary call whose metadata carries a W3C ``traceparent`` (a client's
:class:`smb_protocol.rpc.TraceInterceptor` put it there) is served inside a server
span of that trace, named for the method (``smb.v1.Controller/OpenRegion``); what the
handler calls meanwhile (the controller's calls to memory servers) joins it. Calls
without one (heartbeats, calls made while the client does not trace) pass untouched.
Installed only while tracing is on (:func:`setup`), first, so that refused calls
are traced too.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc

from smb_protocol import tracing

from .grpc_util import Continuation, Handler, ServerInterceptor

log = logging.getLogger(__name__)


class RpcTracing(ServerInterceptor):
    """Continues the caller's trace in a server span around each traced unary call."""

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        parent = next((value for key, value in details.invocation_metadata or ()
                       if key == tracing.TRACEPARENT and isinstance(value, str)), None)
        if parent is None:
            return handler
        name = details.method.lstrip("/")
        inner = handler.unary_unary

        def traced(request: Any, context: grpc.ServicerContext) -> Any:
            with tracing.serving(name, parent, {"rpc.system": "grpc", "rpc.method": name}):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            traced, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def setup(service: str) -> list[ServerInterceptor]:
    """A daemon's tracing: on when the environment asks for it
    (:func:`smb_protocol.tracing.setup_from_env`, spans exported as ``service``); the
    server interceptors it needs, first in line: ``[RpcTracing()]`` while tracing is
    on, else none (nothing to pay)."""
    return [RpcTracing()] if tracing.setup_from_env(service) else []
