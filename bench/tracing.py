"""The cost of tracing on tcp operations: off against on at 1 % sampling, in one run.

    .venv/bin/python bench/tracing.py                    # make bench
    .venv/bin/python bench/tracing.py --quick            # shorter points
    .venv/bin/python bench/tracing.py --ratios 0.01,1    # also every operation traced

Two local clusters of one memory server each, tcp only, the same but for their
environment: one with nothing set (tracing off), one whose daemons trace and export to
a real OTLP receiver in this process (``SMB_OTEL_ENDPOINT``). The client traces only
while it measures the second cluster, sampling each ratio of ``--ratios`` (parent-based,
by trace id, OTLP export in batches to the same receiver). For each size (4 KiB, 16 MiB)
and operation (``Region.write``, ``Region.read_into``) the modes take turns for
``--rounds`` rounds, each point the best of ``--repeats`` runs of at least ``--seconds``;
a mode's throughput is its best round. The ratio is a traced mode's throughput over the
off mode's of the same run; the off rounds' spread (slowest / fastest) is the run's noise.
Results go to ``bench/results/tracing.json`` and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402

from bench.throughput import machine, save, timed  # noqa: E402
from smb_protocol import tracing  # noqa: E402
from smb_protocol.units import format_bytes  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402
from smb_server.testing.otlp import OtlpReceiver  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 16 * MiB]
OPS = ("write", "read")


def mode_name(ratio: float | None) -> str:
    return "off" if ratio is None else f"on, {ratio:.0%} sampled"


def measure(ratios: list[float], rounds: int, seconds: float, repeats: int) -> tuple[dict, int]:
    """{mode: {op: {size: [MB/s per round]}}} and the spans the receiver got."""
    src = np.random.default_rng(0).integers(0, 255, max(SIZES), dtype=np.uint8)
    dst = np.empty_like(src)
    modes: list[float | None] = [None, *ratios]
    rows: dict = {mode_name(m): {op: {str(s): [] for s in SIZES} for op in OPS} for m in modes}
    capacity = f"{max(SIZES) // MiB + 64}M"
    with OtlpReceiver() as receiver:
        traced_env = {"SMB_OTEL_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "500"}
        with LocalCluster(servers=1, capacity=capacity, transports="tcp", log_level="WARNING") as plain, \
                LocalCluster(servers=1, capacity=capacity, transports="tcp", log_level="WARNING",
                             env=traced_env) as traced:
            providers = {r: TracerProvider(sampler=ParentBased(TraceIdRatioBased(r)),
                                           resource=Resource.create({"service.name": "smb-bench"}))
                         for r in ratios}
            for provider in providers.values():
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
            clients = {None: plain.client(transport="tcp")}
            for r in ratios:   # made while tracing is on: its controller channel is traced
                with tracing.collecting(providers[r]):
                    clients[r] = traced.client(transport="tcp")
            for c in clients.values():   # the traced clients share the second cluster's region
                c.create_region("bench/trace", max(SIZES), placement="single", exist_ok=True).close()
            regions = {m: c.open_region("bench/trace") for m, c in clients.items()}
            for size in SIZES:
                fns = {"write": lambda r, size=size: r.write(0, src[:size]),
                       "read": lambda r, size=size: r.read_into(0, dst[:size])}
                for op in OPS:
                    for i in range(rounds):
                        for m in modes:
                            if m is not None:
                                tracing.enable(providers[m])
                            try:
                                fn = fns[op]
                                mbps = timed(lambda m=m, fn=fn: fn(regions[m]), size, seconds, repeats)
                            finally:
                                tracing.disable()
                            rows[mode_name(m)][op][str(size)].append(mbps)
                            print(f"{format_bytes(size):>7} {op:5} round {i + 1}: {mode_name(m):16} "
                                  f"{mbps:10,.1f} MB/s", flush=True)
            for provider in providers.values():
                provider.shutdown()   # export what is left
            for c in clients.values():
                c.close()
        return rows, len(receiver.spans)


def markdown(rows: dict, ratios: list[float]) -> str:
    off = rows[mode_name(None)]
    traced = [mode_name(r) for r in ratios]
    lines = ["| size | op | off (MB/s) | " + " | ".join(f"{t} (MB/s) | ratio" for t in traced)
             + " | off rounds: slowest / fastest |",
             "| --- | --- | ---: |" + " ---: | ---: |" * len(traced) + " ---: |"]
    for size in SIZES:
        for op in OPS:
            base = off[op][str(size)]
            cells = []
            for t in traced:
                best = max(rows[t][op][str(size)])
                cells += [f"{best:,.1f}", f"{best / max(base):.3f}"]
            lines.append(f"| {format_bytes(size)} | {op} | {max(base):,.1f} | " + " | ".join(cells)
                         + f" | {min(base) / max(base):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter points, fewer rounds")
    ap.add_argument("--ratios", default="0.01", help="sampling ratios measured against off (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3, help="turns each mode takes per point")
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum length of one run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per round (best kept)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/tracing.json"))
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",") if r]
    rounds, seconds = (2, 0.3) if args.quick else (args.rounds, args.seconds)
    rows, spans = measure(ratios, rounds, seconds, args.repeats)
    table = markdown(rows, ratios)
    save({**machine(), "rounds": rounds, "seconds": seconds, "repeats": args.repeats, "ratios": ratios,
          "MBps": rows, "spans_received": spans}, table, args.out)
    print(table)
    print(f"spans received: {spans}; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
