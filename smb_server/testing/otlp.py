"""A real OTLP/gRPC trace receiver on loopback, for tests and benchmarks of tracing.

:class:`OtlpReceiver` serves OpenTelemetry's ``TraceService`` (the collector's own
protocol, from ``opentelemetry-proto``) on ``127.0.0.1`` and keeps every span it is
sent, flattened into :class:`ReceivedSpan` records; :meth:`OtlpReceiver.wait_for` blocks
on a condition variable until the spans received satisfy a test (no polling).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it: ids as lowercase hex (``parent_id`` "" for a
    root), the exporting process's ``service.name`` and the span's attributes."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    service: str
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


class OtlpReceiver:
    """Serves ``TraceService.Export`` on ``127.0.0.1:<port>`` (port 0: a free one) until
    :meth:`close`; :attr:`endpoint` is what exporters are pointed at."""

    def __init__(self, port: int = 0) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._changed = threading.Condition()
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
                receiver._received(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="otlp"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)  # type: ignore[no-untyped-call]
        self.port = int(self._server.add_insecure_port(f"127.0.0.1:{port}"))
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _received(self, request: Any) -> None:
        got = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    got.append(ReceivedSpan(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            int(s.kind), service,
                                            {a.key: _value(a.value) for a in s.attributes}))
        with self._changed:
            self.spans.extend(got)
            self.exports += 1
            self._changed.notify_all()

    def wait_for(self, test: Callable[[list[ReceivedSpan]], Any], what: str, timeout: float = 30.0) -> Any:
        """Block until ``test(spans)`` returns something true (evaluated on every export)
        and return it; TimeoutError naming ``what`` after ``timeout`` seconds."""
        with self._changed:
            found = self._changed.wait_for(lambda: test(list(self.spans)), timeout)
            if not found:
                names = sorted({f"{s.service}:{s.name}" for s in self.spans})
                raise TimeoutError(f"{what}: not within {timeout:g} s (received {names})")
            return found

    def close(self) -> None:
        self._server.stop(0).wait()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
