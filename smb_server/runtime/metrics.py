"""Prometheus metrics of one daemon, on :mod:`prometheus_client`.

Each daemon owns a :class:`Registry` (one ``CollectorRegistry``, never the global one)
and serves it with :class:`MetricsServer` on ``/metrics`` (plus ``/healthz``). The thin
wrappers here keep the call sites short (``ops.inc(op="read")``) and add metrics read
from a function at scrape time.

Usage::

    REGISTRY = Registry()
    ops = REGISTRY.counter("smb_operations_total", "Data-plane operations", ["op", "transport"])
    ops.inc(op="read", transport="tcp")
    server = MetricsServer(REGISTRY, port=0)
    server.close()
"""
from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from smb_protocol.errors import Unavailable

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)  # seconds

# ``*_created`` series double the output and nothing here reads them
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client

Source = Callable[[], Iterable[tuple[Sequence[Any], float]]]
"""Yields ``(label values, value)`` pairs at scrape time."""


class _FromFunction(Collector):
    """A gauge or counter whose samples come from ``fn`` at scrape time. A failing
    ``fn`` yields no samples and is logged, so one broken source never breaks a scrape."""

    def __init__(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                 doc: str, labels: Sequence[str], fn: Source) -> None:
        self._kind, self.name, self._doc, self._labels, self._fn = kind, name, doc, list(labels), fn

    def describe(self) -> Iterable[Metric]:
        return [self._kind(self.name, self._doc, labels=self._labels)]

    def collect(self) -> Iterable[Metric]:
        family = self._kind(self.name, self._doc, labels=self._labels)
        try:
            samples = [([str(v) for v in values], float(value)) for values, value in self._fn()]
        except Exception:
            log.exception("metric %s", self.name)
            samples = []
        for values, value in samples:
            family.add_metric(values, value)
        return [family]


class Counter:
    """A value that only goes up, per label values."""

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.collector = prometheus_client.Counter(name, doc, list(labels), registry=None)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (not negative: ValueError) to the series named by ``labels``."""
        (self.collector.labels(**labels) if labels else self.collector).inc(amount)


class Gauge:
    """A value set directly, per label values."""

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.collector = prometheus_client.Gauge(name, doc, list(labels), registry=None)

    def set(self, value: float, **labels: str) -> None:
        (self.collector.labels(**labels) if labels else self.collector).set(value)


class Histogram:
    """Observations (seconds, usually) counted into cumulative buckets."""

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name = name
        self.buckets = tuple(sorted(buckets))
        self.collector = prometheus_client.Histogram(name, doc, list(labels), registry=None,
                                                     buckets=self.buckets)

    def observe(self, value: float, **labels: str) -> None:
        (self.collector.labels(**labels) if labels else self.collector).observe(value)

    def child(self, **labels: str) -> Any:
        """The series of these label values, to observe into without looking its labels
        up each time (a quarter of the cost, for a path that observes every request)."""
        return self.collector.labels(**labels)


class Registry:
    """The metrics of one daemon; :meth:`render` is what ``/metrics`` serves.

    Registering a name twice raises ValueError.
    """

    def __init__(self) -> None:
        self.collectors = CollectorRegistry()

    def register(self, metric: Counter | Gauge | Histogram) -> None:
        """Add a metric made elsewhere (e.g. a histogram owned by the data planes)."""
        self.collectors.register(metric.collector)

    def counter(self, name: str, doc: str, labels: Sequence[str] = (), fn: Source | None = None) -> Counter:
        """A counter; with ``fn``, one read from it at scrape time (nothing to increment)."""
        if fn is not None:
            self.collectors.register(_FromFunction(CounterMetricFamily, name, doc, labels, fn))
        metric = Counter(name, doc, labels)
        if fn is None:
            self.register(metric)
        return metric

    def gauge(self, name: str, doc: str, labels: Sequence[str] = (), fn: Source | None = None) -> Gauge:
        """A gauge; with ``fn``, one read from it at scrape time (nothing to set)."""
        if fn is not None:
            self.collectors.register(_FromFunction(GaugeMetricFamily, name, doc, labels, fn))
        metric = Gauge(name, doc, labels)
        if fn is None:
            self.register(metric)
        return metric

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        metric = Histogram(name, doc, labels, buckets)
        self.register(metric)
        return metric

    def render(self) -> str:
        """Every metric in the Prometheus text exposition format."""
        return prometheus_client.generate_latest(self.collectors).decode()


@dataclass(frozen=True)
class Sample:
    """One sample of a text exposition."""

    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition; ValueError when it is malformed."""
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"not a Prometheus text exposition: {exc}") from None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The ``q`` quantile (0..1) of a histogram from its cumulative ``(le, count)`` buckets,
    interpolated linearly inside the bucket as Prometheus does; NaN when empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be within 0..1, got {q}")
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("metrics: " + format, *args)


class MetricsServer:
    """``GET /metrics`` (prometheus_client's exposition) and ``/healthz`` (200 or 503 from
    ``healthy()``) on ``host:port``; owns its thread, closed by :meth:`close`.

    Raises Unavailable when the port cannot be bound.
    """

    def __init__(self, registry: Registry, host: str = "127.0.0.1", port: int = 0,
                 healthy: Callable[[], bool] = lambda: True) -> None:
        metrics_app = prometheus_client.make_wsgi_app(registry.collectors)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                yield from metrics_app(environ, start_response)
                return
            if path == "/healthz":
                ok = healthy()
                status, body = ("200 OK", b"ok\n") if ok else ("503 Service Unavailable", b"unhealthy\n")
            else:
                status, body = "404 Not Found", b"not found\n"
            start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            yield body

        server_class: type[_Server] = _Server6 if ":" in host else _Server
        try:
            self._httpd = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise Unavailable(f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                              "(port in use? change metrics_port)") from None
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
