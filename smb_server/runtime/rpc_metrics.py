"""Per-method latency and error metrics of a gRPC server, as a server interceptor.

Put it first among the interceptors so that refused calls (a wrong bearer token) are
counted too. Only unary-unary methods are measured; streaming ones (the health
service's ``Watch``) pass through untouched.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from .grpc_util import Continuation, Handler, ServerInterceptor
from .metrics import Counter, Histogram, Registry

log = logging.getLogger(__name__)

# seconds; control calls run from a fraction of a millisecond to a barrier's wait
RPC_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0, 30.0)


class RpcMetrics(ServerInterceptor):
    """Registers ``<prefix>_rpc_seconds{method}`` (a histogram) and
    ``<prefix>_rpc_errors_total{method,code}`` in ``registry`` and feeds them."""

    def __init__(self, registry: Registry, prefix: str) -> None:
        self.latency: Histogram = registry.histogram(
            f"{prefix}_rpc_seconds", "gRPC call latency, seconds", ["method"], buckets=RPC_BUCKETS)
        self.errors: Counter = registry.counter(
            f"{prefix}_rpc_errors_total", "gRPC calls that ended with a status other than OK",
            ["method", "code"])

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rpartition("/")[2] or details.method
        inner = handler.unary_unary

        def measured(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            failed: BaseException | None = None
            try:
                return inner(request, context)
            except BaseException as exc:
                failed = exc
                raise
            finally:
                self.latency.observe(time.perf_counter() - start, method=method)
                code = _code(context, failed)
                if code != "OK":
                    self.errors.inc(method=method, code=code)

        return grpc.unary_unary_rpc_method_handler(
            measured, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _code(context: grpc.ServicerContext, failed: BaseException | None) -> str:
    """The call's status code name; UNKNOWN for an exception that set none."""
    try:
        # ServicerContext.code() exists since grpc 1.38; the type stubs do not list it
        code = context.code()  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if failed is not None else "OK"
