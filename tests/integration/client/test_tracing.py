"""Traces across the client, the controller and a memory server (smb_protocol.tracing).

In one process (the daemons started in-process, the SDK's in-memory exporter) a client
operation, the controller calls it makes and the memory server's handling of its
requests share one trace with the right parents; across real processes (``smb up``'s
daemons configured by the environment) the same spans reach a real OTLP receiver on
loopback. With tracing off, calls carry no trace metadata.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from smb_client import Client
from smb_protocol import rpc, tracing
from smb_server.commands.local_cluster import LocalCluster
from smb_server.controller.main import Controller
from smb_server.memserver.main import MemoryServer
from smb_server.runtime.config import ControllerConfig, ServerConfig
from smb_server.testing.otlp import OtlpReceiver, ReceivedSpan

TOKEN = "trace-token"
SECRET = b"t" * 32
MiB = 1 << 20


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.collecting(provider):
        yield exporter


@pytest.fixture
def in_process(tmp_path: Path, spans: InMemorySpanExporter) -> Iterator[Client]:
    """A controller and a tcp memory server in this process, tracing into ``spans``; the
    client sends requests of at most 1 MiB."""
    ccfg = ControllerConfig(listen="127.0.0.1:0", db_path=str(tmp_path / "c.db"), token=TOKEN,
                            lease_seconds=10.0)
    ccfg.secret = SECRET
    with Controller(ccfg) as controller:
        scfg = ServerConfig(controller=controller.address, capacity=16 * MiB, token=TOKEN, secret=SECRET,
                            state_dir=str(tmp_path / "server"), heartbeat_seconds=0.2, transports=["tcp"])
        with MemoryServer(scfg) as server:
            assert server.wait_registered(10)
            with Client(controller.address, token=TOKEN, transport="tcp", chunk_bytes=MiB) as client:
                yield client


def test_an_operation_the_controller_and_the_server_share_a_trace(in_process, spans):
    region = in_process.create_region("trace/r", MiB)
    spans.clear()
    handle = in_process.open_region("trace/r")
    handle.write(0, np.arange(1024, dtype=np.float32))
    got = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in got:
        by_name.setdefault(s.name, []).append(s)

    (op,) = by_name["smb.open"]
    (rpc_client,) = [s for s in by_name["smb.v1.Controller/OpenRegion"] if s.kind == SpanKind.CLIENT]
    (rpc_server,) = [s for s in by_name["smb.v1.Controller/OpenRegion"] if s.kind == SpanKind.SERVER]
    assert op.parent is None
    assert rpc_client.parent.span_id == op.context.span_id
    assert rpc_server.parent.span_id == rpc_client.context.span_id and rpc_server.parent.is_remote
    assert op.context.trace_id == rpc_client.context.trace_id == rpc_server.context.trace_id

    (write,) = by_name["smb.write"]
    (served,) = by_name["smb.server.write"]
    assert write.parent is None and served.kind == SpanKind.SERVER
    assert served.context.trace_id == write.context.trace_id != op.context.trace_id
    assert served.parent.span_id == write.context.span_id
    assert served.attributes["smb.bytes"] == 4096 and served.attributes["smb.extent"] > 0
    assert "smb.v1.Controller/Heartbeat" not in by_name      # calls outside a trace make no span
    region.close()


def test_requests_sent_from_the_io_pool_join_the_operation(in_process, spans):
    """A write sent as several requests (1 MiB each): every request's server span is a child of
    the one operation, whichever thread of the client's pool sent it."""
    region = in_process.create_region("trace/chunked", 4 * MiB)
    spans.clear()
    region.write(0, bytes(4 * MiB))
    got = spans.get_finished_spans()
    (op,) = [s for s in got if s.name == "smb.write"]
    served = [s for s in got if s.name == "smb.server.write"]
    assert len(served) >= 2
    assert {s.parent.span_id for s in served} == {op.context.span_id}


def test_with_tracing_off_calls_carry_no_trace_metadata():
    seen: list[dict[str, str]] = []

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(dict(context.invocation_metadata()))
        return request

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        def call(channel: grpc.Channel) -> None:
            rpc.call(channel.unary_unary("/test.Echo/Echo"), b"x", "tok", 5.0)

        assert not tracing.enabled()
        with rpc.channel(f"127.0.0.1:{port}") as plain:
            call(plain)
        provider = TracerProvider()
        with tracing.collecting(provider), rpc.channel(f"127.0.0.1:{port}") as traced:
            call(traced)                                  # on, but outside any trace
            with tracing.operation("open"):
                call(traced)
        assert [tracing.TRACEPARENT in md for md in seen] == [False, False, True]
        assert all(md["authorization"] == "Bearer tok" for md in seen)
    finally:
        server.stop(0).wait()


def _linked(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan] | None:
    """The client's write, the controller's OpenRegion and the server's write of one
    run, once all have arrived."""
    ops = {s.name: s for s in spans if s.service == "smb-test-client"}
    if "smb.write" not in ops or "smb.open" not in ops:
        return None
    served = [s for s in spans if s.service == "smb-server" and s.name == "smb.server.write"
              and s.parent_id == ops["smb.write"].span_id]
    rpc_server = [s for s in spans if s.service == "smb-controller" and s.name == "smb.v1.Controller/OpenRegion"
                  and s.trace_id == ops["smb.open"].trace_id]
    if not served or not rpc_server:
        return None
    return {"write": ops["smb.write"], "open": ops["smb.open"], "served": served[0], "rpc": rpc_server[0]}


def test_spans_of_real_processes_reach_an_otlp_receiver(tmp_path):
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SMB_", "OTEL_"))}
        env.update(SMB_OTEL_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="50")
        provider = TracerProvider(resource=Resource.create({"service.name": "smb-test-client"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
        with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"), env=env,
                          transports="tcp", log_level="INFO") as cluster, tracing.collecting(provider):
            with cluster.client(transport="tcp") as c:
                c.create_region("trace/otlp", MiB)
                c.open_region("trace/otlp").write(0, b"traced" * 100)
            found = receiver.wait_for(_linked, "the client's, the controller's and the server's spans")
        provider.shutdown()
    assert found["served"].trace_id == found["write"].trace_id
    assert found["served"].kind == SpanKind.SERVER.value + 1   # OTLP numbers kinds from 1 (internal)
    rpc_client = [s for s in receiver.spans if s.service == "smb-test-client"
                  and s.span_id == found["rpc"].parent_id]
    assert rpc_client and rpc_client[0].parent_id == found["open"].span_id


def test_servers_that_do_not_trace_serve_traced_requests(cluster, name, spans):
    """The session's cluster traces nothing: its memory servers read the traceparent of
    a traced client's requests, drop it, and serve the requests as usual."""
    data = np.arange(1 << 16, dtype=np.float32)
    with cluster.client(transport="tcp") as c:
        region = c.create_region(name, 1 << 20)
        region.write(0, data)
        region.accumulate(0, data)
        assert np.array_equal(region.read(0, data.nbytes, dtype="float32"), 2 * data)
        c.delete_region(name)
    assert {"smb.write", "smb.accumulate", "smb.read"} <= {s.name for s in spans.get_finished_spans()}
