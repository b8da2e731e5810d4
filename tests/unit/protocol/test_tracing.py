"""smb_protocol.tracing without a network: configuration from the environment, spans
and their parents, and the trace context a tcp frame carries only when sampled."""
from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind

from smb_protocol import tracing, wire
from smb_protocol.errors import InvalidArgument
from smb_protocol.framing import ClientFrames
from smb_protocol.requests import Write, from_frame
from smb_protocol.wire import Op


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.collecting(provider):
        yield exporter


def _write() -> Write:
    return Write(Op.WRITE, 0, extent_id=7, offset=64, length=4, client=9, seq=3)


def test_off_by_default_and_what_turns_it_on():
    assert not tracing.enabled()
    assert tracing.requested({}) is None
    assert tracing.requested({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.requested({"OTEL_TRACES_EXPORTER": "otlp"}) == "otlp"
    assert tracing.requested({"SMB_OTEL_ENDPOINT": "http://127.0.0.1:4317"}) == "otlp"
    assert tracing.requested({"SMB_OTEL_EXPORTER": "console", "OTEL_TRACES_EXPORTER": "otlp"}) == "console"
    assert tracing.requested({"SMB_OTEL_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(InvalidArgument, match="zipkin.*otlp, console, none"):
        tracing.requested({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert not tracing.setup_from_env("smb-test", {})
    assert not tracing.enabled()


def test_nothing_is_imported_while_off():
    """The library's import and a request's frames touch no OpenTelemetry module."""
    code = ("import sys; import smb_client; from smb_protocol.framing import ClientFrames; "
            "from smb_protocol.requests import Read; from smb_protocol.wire import Op; "
            "ClientFrames('x').request(Read(Op.READ, 0, 1, 0, 8)); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_frame_is_unchanged_while_tracing_is_off():
    payload = memoryview(b"abcd")
    _, frames = ClientFrames("test").request(_write(), [payload])
    assert frames == [_write().to_frame(1), payload]
    assert frames[0][2] == Op.WRITE                       # the op byte has no TRACED bit
    assert len(frames[0]) == wire.REQUEST.size


def test_a_sampled_request_carries_its_traceparent(spans):
    payload = memoryview(b"abcd")
    with tracing.operation("write"):
        _, frames = ClientFrames("test").request(_write(), [payload])
    (span,) = spans.get_finished_spans()
    header, trace, body = frames
    assert header[2] == Op.WRITE | wire.TRACED and body is payload
    assert len(trace) == wire.TRACE_SIZE
    assert trace.decode() == (f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}"
                              f"-{int(span.context.trace_flags):02x}")
    assert int(trace[-2:], 16) & 1                      # sampled
    fields = wire.REQUEST.unpack(header)
    assert fields[1] & ~wire.TRACED == Op.WRITE and fields[6] == 4   # length counts the payload only


def test_an_unsampled_or_untraced_request_carries_nothing():
    provider = TracerProvider(sampler=ALWAYS_OFF)
    with tracing.collecting(provider):
        with tracing.operation("write"):
            _, frames = ClientFrames("test").request(_write())
        assert frames == [_write().to_frame(1)]
        _, frames = ClientFrames("test").request(_write())   # on, but outside any operation
        assert frames == [_write().to_frame(1)]


def test_the_server_side_continues_the_trace(spans):
    with tracing.operation("read") as op:
        parent = tracing.traceparent()
    assert parent is not None
    req = from_frame(Op.READ, 0, 1, 7, 0, 8, 0, 0, 0.0, 0, 0, trace=parent)
    assert req.trace == parent
    with tracing.serving("smb.server.read", req.trace, {"smb.extent": 7}):
        pass
    with tracing.serving("smb.server.read", b"not a traceparent"):
        pass                                              # no parent: no span
    server, client = sorted(spans.get_finished_spans(), key=lambda s: s.kind != SpanKind.SERVER)
    assert server.kind == SpanKind.SERVER and server.name == "smb.server.read"
    assert server.context.trace_id == client.context.trace_id == op.get_span_context().trace_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote
    assert dict(server.attributes) == {"smb.extent": 7}


def test_client_spans_only_inside_a_trace(spans):
    assert tracing.client_span("smb.v1.Controller/Heartbeat") is None
    with tracing.operation("open"):
        span = tracing.client_span("smb.v1.Controller/OpenRegion")
        assert span is not None
        tracing.end(span, RuntimeError("refused"))
    rpc, op = spans.get_finished_spans()
    assert rpc.kind == SpanKind.CLIENT and rpc.parent.span_id == op.context.span_id
    assert not rpc.status.is_ok and rpc.events[0].name == "exception"


def test_carried_runs_under_the_callers_context(spans):
    import threading
    seen = []
    with tracing.operation("read") as op:
        fn = tracing.carried(lambda: seen.append(tracing.traceparent()))
    t = threading.Thread(target=fn)
    t.start()
    t.join()
    assert seen[0] is not None and f"{op.get_span_context().span_id:016x}" in seen[0].decode()
