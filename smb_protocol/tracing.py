"""Traces across processes with OpenTelemetry; off by default.

While tracing is off (the default) nothing here imports OpenTelemetry, and every hook
the library calls costs one global read: no span, no header, no metadata.

It is on in a process once :func:`enable` gave it a tracer provider, or once
:func:`setup_from_env` (every :class:`~smb_client.Client`, ``smb controller`` and ``smb
server`` call it) finds it asked for in the environment:

* ``SMB_OTEL_EXPORTER`` (``otlp`` or ``console``; ``none``: off), else the standard
  ``OTEL_TRACES_EXPORTER``; ``SMB_OTEL_ENDPOINT`` alone means ``otlp``;
* ``SMB_OTEL_ENDPOINT``: the OTLP/gRPC collector (``http://host:4317``), else the
  exporter's own ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
  (default ``http://localhost:4317``);
* ``SMB_OTEL_SAMPLE_RATIO``: the fraction of new traces kept (parent-based, by trace id),
  else the SDK's ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: all);
* ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` as usual (the default service
  names are ``smb-client``, ``smb-controller`` and ``smb-server``);
  ``OTEL_SDK_DISABLED=true`` keeps it off.

Clients start traces: an operation (``smb.read``, ``smb.write``, ``smb.open``, ...) is a
span; a controller call made inside one is a child span (``smb.v1.Controller/OpenRegion``)
whose context travels in the gRPC metadata (``traceparent``); a tcp data-plane request
made inside a *sampled* one carries its W3C ``traceparent`` in the frame
(:data:`smb_protocol.wire.TRACED`). Servers only continue traces: a call or a request
that arrives with a context is a server span, child of the caller's; one without gets
none (heartbeats and unsampled requests cost nothing).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import InvalidArgument

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

EXPORTER_ENV = "SMB_OTEL_EXPORTER"
ENDPOINT_ENV = "SMB_OTEL_ENDPOINT"
SAMPLE_ENV = "SMB_OTEL_SAMPLE_RATIO"
EXPORTERS = ("otlp", "console")
TRACEPARENT = "traceparent"          # the gRPC metadata key (W3C trace context)

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_tracer: Tracer | None = None        # None: tracing is off
_provider: Any = None                # the provider :func:`setup_from_env` made (shut down by disable)
_api: Any = None                     # the opentelemetry.trace module, once on


def enabled() -> bool:
    """Whether this process traces."""
    return _tracer is not None


def requested(env: Mapping[str, str] = os.environ) -> str | None:
    """The exporter ``env`` asks for (``otlp``, ``console``), or None: tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = (env.get(EXPORTER_ENV, "").strip() or env.get("OTEL_TRACES_EXPORTER", "").strip()).lower()
    if not exporter and env.get(ENDPOINT_ENV, "").strip():
        exporter = "otlp"
    if exporter in ("", "none"):
        return None
    if exporter not in EXPORTERS:
        raise InvalidArgument(f"trace exporter {exporter!r} ({EXPORTER_ENV} or OTEL_TRACES_EXPORTER) is not "
                              f"one of {', '.join(EXPORTERS)}, none")
    return exporter


def setup_from_env(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on when ``env`` asks for it (see the module docstring), exporting as
    ``service`` unless ``OTEL_SERVICE_NAME`` names one; once per process (a later call,
    or one after :func:`enable`, changes nothing). Returns :func:`enabled`."""
    global _provider
    exporter = requested(env)
    if exporter is None or _tracer is not None:
        return enabled()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = env.get(SAMPLE_ENV, "").strip()
    try:
        sampler = ParentBased(TraceIdRatioBased(float(ratio))) if ratio else None
    except ValueError:
        raise InvalidArgument(f"{SAMPLE_ENV}={ratio!r}: give a fraction from 0 to 1") from None
    attributes = {} if env.get("OTEL_SERVICE_NAME", "").strip() else {"service.name": service}
    provider = TracerProvider(sampler=sampler, resource=Resource.create(attributes))
    sink: SpanExporter
    if exporter == "console":
        sink = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        endpoint = env.get(ENDPOINT_ENV, "").strip() or None
        sink = OTLPSpanExporter(endpoint=endpoint)   # http:// in the clear, https:// over TLS
    provider.add_span_processor(BatchSpanProcessor(sink))
    with _lock:
        if _tracer is None:
            _provider = provider
            enable(provider)
            log.info("tracing on: %s spans as %s", exporter, provider.resource.attributes.get("service.name"))
            return True
    provider.shutdown()   # another thread turned it on meanwhile
    return enabled()


def enable(provider: TracerProvider | None = None) -> None:
    """Trace with ``provider`` (default: OpenTelemetry's global one, which an
    application may have set up itself). The caller keeps ownership of ``provider``."""
    global _tracer, _api
    from opentelemetry import trace
    _api = trace
    _tracer = (provider or trace.get_tracer_provider()).get_tracer("smb")


def disable() -> None:
    """Stop tracing (spans already made still end); shuts down a provider that
    :func:`setup_from_env` made, flushing what it holds."""
    global _tracer, _provider
    with _lock:
        _tracer, provider, _provider = None, _provider, None
    if provider is not None:
        provider.shutdown()


# -- spans ---------------------------------------------------------------------------------
def operation(name: str) -> contextlib.AbstractContextManager[Any]:
    """A client operation's span (``smb.<name>``), current for the block (a no-op while
    tracing is off)."""
    tracer = _tracer
    if tracer is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(f"smb.{name}")


def traced(name: str) -> Callable[[F], F]:
    """A function decorated to run as the operation ``name`` (:func:`operation`)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _tracer is None:
                return fn(*args, **kwargs)
            with operation(name):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


def serving(name: str, traceparent: bytes | str | None,
            attributes: Mapping[str, str | int] | None = None) -> contextlib.AbstractContextManager[Any]:
    """A server span (``name``) for a request that arrived with ``traceparent``, child
    of the caller's span and current for the block; a no-op while tracing is off or
    without a context."""
    tracer = _tracer
    if tracer is None or not traceparent:
        return contextlib.nullcontext()
    parent = _context(traceparent)
    if parent is None:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(name, context=parent, kind=_api.SpanKind.SERVER,
                                        attributes=dict(attributes or {}))


def client_span(name: str) -> Span | None:
    """A started client span (``name``, an outgoing call) under the current span, or
    None while tracing is off or outside any recording span. The caller ends it."""
    tracer = _tracer
    if tracer is None or not _api.get_current_span().is_recording():
        return None
    return tracer.start_span(name, kind=_api.SpanKind.CLIENT)


def end(span: Span, error: BaseException | None = None) -> None:
    """End ``span``, marked failed with ``error``."""
    if error is not None:
        span.record_exception(error)
        span.set_status(_api.Status(_api.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def traceparent(span: Span | None = None) -> bytes | None:
    """The W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``: 55 ASCII bytes) of ``span``
    (default: the current one) when tracing is on and it is sampled; else None."""
    if _tracer is None:
        return None
    ctx = (span or _api.get_current_span()).get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled):
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}".encode()


def _context(traceparent: bytes | str) -> Context | None:
    """The remote parent a ``traceparent`` names (None for one that does not parse)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    text = traceparent.decode("ascii", "replace") if isinstance(traceparent, bytes) else traceparent
    ctx = TraceContextTextMapPropagator().extract({TRACEPARENT: text})
    return ctx if _api.get_current_span(ctx).get_span_context().is_valid else None


# -- threads -------------------------------------------------------------------------------
def carried(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` made to run, on whatever thread, under the context current here (so the
    requests of one operation, sent from a pool of threads, join its trace); ``fn``
    itself while tracing is off."""
    if _tracer is None:
        return fn
    from opentelemetry import context
    captured = context.get_current()

    def run() -> Any:
        token = context.attach(captured)
        try:
            return fn()
        finally:
            context.detach(token)
    return run


@contextlib.contextmanager
def collecting(provider: TracerProvider) -> Iterator[None]:
    """Trace with ``provider`` for the block, then turn tracing off (for tests)."""
    enable(provider)
    try:
        yield
    finally:
        disable()
