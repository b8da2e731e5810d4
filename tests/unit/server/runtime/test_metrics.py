"""Metrics exposition and parsing, latency quantiles, the data planes' counters, and
JSON logs."""
from __future__ import annotations

import io
import json
import logging
import math
import urllib.error
import urllib.request

import pytest

from smb_protocol.errors import Unavailable
from smb_server.memserver.stats import PlaneStats
from smb_server.runtime import logs
from smb_server.runtime.metrics import MetricsServer, Registry, histogram_quantile, parse


def values(reg: Registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a render, read back with the Prometheus parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse(reg.render())}


def test_metrics_exposition():
    reg = Registry()
    ops = reg.counter("smb_ops_total", "operations", ["op"])
    ops.inc(op="read")
    ops.inc(2, op="read")
    lat = reg.histogram("smb_op_seconds", "latency", ["op"], buckets=(0.001, 0.01))
    lat.observe(0.005, op="read")
    lat.observe(5.0, op="read")
    text = reg.render()
    assert "# TYPE smb_ops_total counter" in text and "# TYPE smb_op_seconds histogram" in text
    assert "_created" not in text
    got = values(reg)
    assert got[("smb_ops_total", (("op", "read"),))] == 3
    assert got[("smb_op_seconds_bucket", (("le", "0.001"), ("op", "read")))] == 0
    assert got[("smb_op_seconds_bucket", (("le", "0.01"), ("op", "read")))] == 1
    assert got[("smb_op_seconds_bucket", (("le", "+Inf"), ("op", "read")))] == 2
    assert got[("smb_op_seconds_count", (("op", "read"),))] == 2
    assert got[("smb_op_seconds_sum", (("op", "read"),))] == pytest.approx(5.005)
    with pytest.raises(ValueError):
        ops.inc(transport="tcp")
    with pytest.raises(ValueError):
        ops.inc(-1, op="read")
    with pytest.raises(ValueError, match="Duplicated"):
        reg.counter("smb_ops_total", "again")


def test_registries_are_separate():
    one, two = Registry(), Registry()
    one.counter("x_total", "x").inc()
    two.counter("x_total", "x").inc(5)
    assert values(one)[("x_total", ())] == 1 and values(two)[("x_total", ())] == 5


def test_parse_reads_back_what_render_writes():
    reg = Registry()
    reg.counter("c_total", "c", ["path"]).inc(3, path='a "quoted"\\ path\nwith newline')
    reg.gauge("g", "g", fn=lambda: [((), 2.5)])
    reg.counter("from_fn_total", "f", ["transport"], fn=lambda: [(("tcp",), 7), (("shm",), 0)])
    samples = values(reg)
    assert samples[("c_total", (("path", 'a "quoted"\\ path\nwith newline'),))] == 3
    assert samples[("g", ())] == 2.5
    assert samples[("from_fn_total", (("transport", "tcp"),))] == 7
    assert "# TYPE from_fn_total counter" in reg.render()
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse("ok 1\nnot a sample line {\n")


def test_a_failing_source_does_not_break_the_scrape():
    reg = Registry()
    reg.gauge("broken", "b", fn=lambda: 1 / 0)
    reg.gauge("fine", "f", fn=lambda: [((), 1)])
    text = reg.render()
    assert "# TYPE broken gauge" in text
    assert values(reg) == {("fine", ()): 1}


def test_metrics_server_serves_metrics_healthz_and_404():
    reg = Registry()
    reg.counter("hits_total", "hits").inc(4)
    healthy = [True]
    server = MetricsServer(reg, port=0, healthy=lambda: healthy[0])
    base = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            assert {s.name: s.value for s in parse(reply.read().decode())}["hits_total"] == 4
        with urllib.request.urlopen(base + "/healthz", timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b"ok\n"
        healthy[0] = False
        for path, code in (("/healthz", 503), ("/other", 404)):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(base + path, timeout=10)
            assert info.value.code == code
        with pytest.raises(Unavailable, match="metrics_port"):
            MetricsServer(reg, port=server.port)
    finally:
        server.close()


def test_histogram_quantile():
    # 10 observations: 5 below 0.1, 4 in (0.1, 1], 1 above 1
    buckets = [(0.1, 5), (1.0, 9), (math.inf, 10)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.9 * (7 - 5) / 4)
    assert histogram_quantile(0.99, buckets) == 1.0           # in the +Inf bucket: its lower bound
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]))
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_plane_stats_per_transport_and_totals():
    root = PlaneStats()
    tcp, shm = root.for_transport("tcp"), root.for_transport("shm")
    assert root.for_transport("tcp") is tcp
    tcp.add(bytes_written=100, operations=1, sessions=1)
    tcp.add(bytes_read=40, operations=1)
    shm.add(operations=1, errors=1, sessions=2)
    shm.add(sessions=-1)
    assert root.snapshot() == {"bytes_read": 40, "bytes_written": 100, "bytes_accumulated": 0,
                               "operations": 3, "errors": 1, "sessions": 2, "repeats": 0}
    by = root.by_transport()
    assert by["tcp"]["bytes_written"] == 100 and by["shm"]["sessions"] == 1 and by["shm"]["errors"] == 1
    tcp.observe("write", 0.0002)
    shm.observe("attach", 0.00003)
    reg = Registry()
    reg.register(root.latency)
    got = values(reg)
    assert got[("smb_server_operation_seconds_count", (("op", "write"), ("transport", "tcp")))] == 1
    assert got[("smb_server_operation_seconds_count", (("op", "attach"), ("transport", "shm")))] == 1
    with pytest.raises(KeyError, match="unknown counter"):
        tcp.add(bytez=1)


@pytest.fixture
def root_logger():
    """Put the root logger's handlers and level back after a test that reconfigures it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_logs_carry_context_extra_fields_and_tracebacks(root_logger):
    out = io.StringIO()
    logs.setup("INFO", "json", stream=out)
    logs.set_context(daemon="memory-server", server_id="abc")
    try:
        log = logging.getLogger("smb_server.test")
        log.debug("hidden")
        log.info("reserved %d bytes", 4096, extra={"extent_id": 7})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        logs.set_context(daemon=None, server_id=None)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(records) == 2
    first, second = records
    assert first["msg"] == "reserved 4096 bytes" and first["level"] == "INFO"
    assert first["logger"] == "smb_server.test" and first["extent_id"] == 7
    assert first["daemon"] == "memory-server" and first["server_id"] == "abc"
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc"]


def test_log_setup_refuses_unknown_format_and_level(root_logger):
    with pytest.raises(ValueError, match="log format"):
        logs.setup("INFO", "xml")
    with pytest.raises(ValueError, match="log level"):
        logs.setup("LOUD", "text")
