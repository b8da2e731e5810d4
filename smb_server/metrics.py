"""Prometheus metrics: counters, gauges and histograms in the text exposition format,
served on ``/metrics`` by a small HTTP thread. No client library needed.

Usage::

    REGISTRY = Registry()
    ops = REGISTRY.counter("smb_operations_total", "Data-plane operations", ["op", "transport"])
    ops.inc(op="read", transport="tcp")
    serve_metrics(REGISTRY, port=9100)
"""
from __future__ import annotations

import bisect
import logging
import math
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Sequence

from smb_client.errors import Unavailable

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)  # seconds


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A value that only goes up: incremented with :meth:`inc`, or read from ``fn`` at
    scrape time (``fn`` yields ``(label values, value)`` pairs)."""

    kind = "counter"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (),
                 fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None) -> None:
        super().__init__(name, doc, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._fn = fn

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}"
                                for k, v in _items(self, self._values, self._fn)]


class Gauge(_Metric):
    """A value set directly, or read from ``fn`` at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (),
                 fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None) -> None:
        super().__init__(name, doc, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._fn = fn

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}"
                                for k, v in _items(self, self._values, self._fn)]


def _items(metric: _Metric, values: dict[tuple[str, ...], float],
           fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None) -> list[tuple[tuple[str, ...], float]]:
    """The samples to render: from ``fn`` when given (a failing one yields none and is
    logged, so that one broken source never breaks the scrape), else the stored values."""
    if fn is None:
        with metric._lock:
            return sorted(values.items())
    try:
        return [(tuple(str(x) for x in k), v) for k, v in fn()]
    except Exception:
        log.exception("metric %s", metric.name)
        return []


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, doc, labels)
        self.buckets = tuple(sorted(buckets))
        self._data: dict[tuple[str, ...], list[float]] = {}  # bucket counts..., sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            d = self._data.setdefault(key, [0.0] * (len(self.buckets) + 2))
            if i < len(self.buckets):
                d[i] += 1
            d[-2] += value
            d[-1] += 1

    def render(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        for key, d in items:
            running = 0.0
            for b, n in zip(self.buckets, d):
                running += n
                le = 'le="%s"' % _num(b)
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_num(running)}")
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_labels(self.labelnames, key, inf)} {_num(d[-1])}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(d[-2])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {_num(d[-1])}")
        return out


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def _add(self, m: _Metric) -> _Metric:
        if any(x.name == m.name for x in self._metrics):
            raise ValueError(f"metric {m.name} is already registered")
        self._metrics.append(m)
        return m

    def register(self, metric: _Metric) -> None:
        """Add a metric made elsewhere (e.g. a histogram owned by the data planes)."""
        self._add(metric)

    def counter(self, name: str, doc: str, labels: Sequence[str] = (),
                fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None) -> Counter:
        return self._add(Counter(name, doc, labels, fn))  # type: ignore[return-value]

    def gauge(self, name: str, doc: str, labels: Sequence[str] = (),
              fn: Callable[[], Iterable[tuple[Sequence[str], float]]] | None = None) -> Gauge:
        return self._add(Gauge(name, doc, labels, fn))  # type: ignore[return-value]

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, doc, labels, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Sample:
    """One line of the text exposition format."""

    name: str
    labels: dict[str, str]
    value: float


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r"\\(.)")


def _unescape(m: re.Match) -> str:
    return "\n" if m.group(1) == "n" else m.group(1)


def parse(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments skipped).

    Raises ValueError naming the first line that is not a sample.
    """
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"line {number} is not a metric sample: {line[:80]!r}")
        labels = {k: _ESCAPED.sub(_unescape, v) for k, v in _LABEL.findall(m.group(2) or "")}
        samples.append(Sample(m.group(1), labels, float(m.group(3))))
    return samples


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


class MetricsServer:
    """``GET /metrics`` (and ``/healthz``) on ``host:port``; owns its thread.

    Raises Unavailable when the port cannot be bound.
    """

    def __init__(self, registry: Registry, host: str = "127.0.0.1", port: int = 0,
                 healthy: Callable[[], bool] = lambda: True) -> None:
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?")[0] == "/metrics":
                    body, code = reg.render().encode(), 200
                    ctype = "text/plain; version=0.0.4; charset=utf-8"
                elif self.path == "/healthz":
                    ok = healthy()
                    body, code, ctype = (b"ok\n" if ok else b"unhealthy\n"), (200 if ok else 503), "text/plain"
                else:
                    body, code, ctype = b"not found\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("metrics: " + fmt, *args)

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise Unavailable(f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                              "(port in use? change metrics_port)") from None
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
