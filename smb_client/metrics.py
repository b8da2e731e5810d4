"""A client process's own latency histograms, on :mod:`prometheus_client`; off by default.

``smb_client_operation_seconds{op=...}`` counts the time of each region operation as
the caller sees it (the network, the servers' queues, retries and waits included), under
the operation names and buckets of the memory servers' ``smb_server_operation_seconds``
(:mod:`smb_protocol.latency`), so one dashboard puts both sides of an operation side by
side: ``read``, ``write``, ``accumulate``, ``axpy``, ``scale``, ``fetch_add``,
``compare_swap``, ``wait`` and ``lock`` on regions, ``reduce`` and ``broadcast`` for a
collective's rounds, ``open`` and ``barrier`` at the controller.

Turn it on with :func:`serve` (or ``SMB_CLIENT_METRICS_PORT``, read when a
:class:`~smb_client.Client` is made): the histograms are served at
``http://<addr>:<port>/metrics``. While it and tracing are off, a :func:`timed_method`
call costs two global reads.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import prometheus_client
from prometheus_client.registry import CollectorRegistry

from smb_protocol import tracing
from smb_protocol.latency import CLIENT_HISTOGRAM, OP_BUCKETS

log = logging.getLogger(__name__)

__all__ = ["ADDR_ENV", "DEFAULT_ADDR", "PORT_ENV", "disable", "enable", "observe", "serve", "serve_from_env",
           "timed_method"]

PORT_ENV = "SMB_CLIENT_METRICS_PORT"
ADDR_ENV = "SMB_CLIENT_METRICS_ADDR"
DEFAULT_ADDR = "127.0.0.1"   # scraped from this host unless asked otherwise

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_histogram: prometheus_client.Histogram | None = None
_registry: CollectorRegistry | None = None
_served: dict[tuple[str, int], int] = {}
_env_lock = threading.Lock()
_env_port: int | None = None   # what serve_from_env served


def enable() -> CollectorRegistry:
    """Start counting (idempotent); returns the registry the histograms live in (for a
    caller that serves or pushes it itself)."""
    global _histogram, _registry
    with _lock:
        if _registry is None:
            registry = CollectorRegistry()
            _histogram = prometheus_client.Histogram(
                CLIENT_HISTOGRAM, "Region operation latency seen by this client process, seconds",
                ["op"], registry=registry, buckets=OP_BUCKETS)
            _registry = registry
        return _registry


def serve(port: int, addr: str = DEFAULT_ADDR) -> int:
    """Count and serve ``/metrics`` on ``addr:port`` (port 0: a free one); returns the
    port. Serving the same address again returns the port already served."""
    registry = enable()
    with _lock:
        key = (addr, port)
        if port and key in _served:
            return _served[key]
        server, _ = prometheus_client.start_http_server(port, addr=addr, registry=registry)
        bound = int(server.server_port)
        _served[key] = _served[(addr, bound)] = bound
    log.info("client metrics at http://%s:%d/metrics", addr, bound)
    return bound


def serve_from_env() -> int | None:
    """:func:`serve` on ``SMB_CLIENT_METRICS_PORT`` (and ``SMB_CLIENT_METRICS_ADDR``) when
    set, once per process (every Client calls it; port 0 picks one free port, not one per
    Client); the port served, or None."""
    global _env_port
    port = os.environ.get(PORT_ENV, "").strip()
    if not port:
        return None
    with _env_lock:
        if _env_port is None:
            _env_port = serve(int(port), os.environ.get(ADDR_ENV, "").strip() or DEFAULT_ADDR)
        return _env_port


def disable() -> None:
    """Stop counting (what was served stays served, unchanging)."""
    global _histogram, _registry
    with _lock:
        _histogram = None
        _registry = None


def observe(op: str, seconds: float) -> None:
    """Count one ``op`` that took ``seconds`` (nothing while counting is off)."""
    histogram = _histogram
    if histogram is not None:
        histogram.labels(op=op).observe(seconds)


def timed_method(op: str) -> Callable[[F], F]:
    """A method decorated to count each call as one ``op``, failed or not, and, while
    tracing is on (:mod:`smb_protocol.tracing`), to run it as the span ``smb.<op>``."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _histogram is None and not tracing.enabled():
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                with tracing.operation(op):
                    return fn(*args, **kwargs)
            finally:
                observe(op, time.perf_counter() - start)
        return run  # type: ignore[return-value]
    return wrap
