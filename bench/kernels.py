"""The memory server's elementwise kernels, each against a memcpy of the same bytes in
the same run, on one thread and on several at once.

    .venv/bin/python bench/kernels.py                    # 64 and 512 KiB, 1 and 2 threads
    .venv/bin/python bench/kernels.py --kib 512 --threads 1,2 --out results.jsonl

Every kernel runs through the face the server and clients call
(``smb_server.memserver.kernels``: ``accumulate``, ``axpy``, ``scale``; a collective's push
through the server's chunk step, ``smb_server.memserver._native.push_step``, its lock and
round rules included; ``smb_protocol.chunk_types``: ``narrow``, ``widen``), on buffers of ``--kib`` KiB of its
destination type, so the figures include each call's Python. The reference is
``numpy.copyto`` of the same destination bytes (memcpy). Printed per kernel, size and
thread count, one JSON line: microseconds per call (the best of ``--repeat`` timings of
``--calls`` calls each), GB/s of destination bytes, the ratio of memcpy's time to the
kernel's (1.0: as fast as a copy), and with several threads the speed-up over one
thread (each thread its own buffers; only work done without the interpreter lock
runs on several cores at once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.process_cpu import write_lines  # noqa: E402
from smb_protocol.chunk_types import narrow, widen  # noqa: E402
from smb_protocol.dtypes import STORAGE, DType, f32_to_bf16  # noqa: E402
from smb_protocol.rounds import count_word  # noqa: E402
from smb_server.memserver import _native, kernels  # noqa: E402

F32 = DType.FLOAT32


def _operand(dt: DType, n: int, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(values)
    return values.astype(STORAGE[dt])


def cases(nbytes: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Kernel name -> a maker of one call on fresh buffers (``nbytes`` of destination)."""
    def arith(op: str, dt: DType) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            n = nbytes // STORAGE[dt].itemsize
            d, s = _operand(dt, n, 1), _operand(dt, n, 2)
            dv, sv = d.data.cast("B"), s.data.cast("B")
            if op == "accumulate":
                return lambda: kernels.accumulate(dv, sv, dt)
            if op == "axpy":
                return lambda: kernels.axpy(dv, 1e-3, sv, dt)
            return lambda: kernels.scale(dv, 1.0, dt)
        return make

    def push(wire: DType, first: bool) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            n, lock = nbytes // 4, _native.Mutex()
            extent = np.zeros(n * 4 + 8, np.uint8)   # the float32 slot, then its count word
            word = extent[n * 4:].view("<i8")
            data, sv = extent.data.cast("B"), _operand(wire, n, 2).data.cast("B")
            found = 0 if first else count_word(0, 1)   # the round's first push, or its second of two

            def call() -> None:
                word[0] = found
                _native.push_step(lock, data, n * 4, 0, sv, F32, wire, 2, 0, False)
            return call
        return make

    def conversion(kind: str, wire: DType) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            if kind == "narrow":   # destination: the 16-bit elements
                n = nbytes // 2
                src, out = _operand(F32, n, 1), np.empty(n, STORAGE[wire])
                return lambda: narrow(src, wire, out)
            n = nbytes // 4
            raw, wide = _operand(wire, n, 1), np.empty(n, np.float32)
            return lambda: widen(raw, wire, wide)
        return make

    made: dict[str, Callable[[], Callable[[], None]]] = {}
    for dt in (F32, DType.FLOAT64, DType.INT64, DType.BFLOAT16, DType.FLOAT16):
        made[f"accumulate {dt.name.lower()}"] = arith("accumulate", dt)
    for dt in (F32, DType.BFLOAT16, DType.FLOAT16):
        made[f"axpy {dt.name.lower()}"] = arith("axpy", dt)
        made[f"scale {dt.name.lower()}"] = arith("scale", dt)
    for wire in (DType.BFLOAT16, DType.FLOAT16):
        name = wire.name.lower()
        made[f"push {name} into float32 (first)"] = push(wire, True)
        made[f"push {name} into float32 (added)"] = push(wire, False)
        made[f"narrow float32 to {name}"] = conversion("narrow", wire)
        made[f"widen {name} to float32"] = conversion("widen", wire)
    return made


def memcpy(nbytes: int) -> Callable[[], Callable[[], None]]:
    def make() -> Callable[[], None]:
        d, s = np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        return lambda: np.copyto(d, s)
    return make


def timed(make: Callable[[], Callable[[], None]], threads: int, calls: int, repeat: int) -> float:
    """Seconds per call: the best of ``repeat`` timings, each of ``threads`` threads
    making ``calls`` calls on buffers of their own (the slowest thread's time)."""
    fns = [make() for _ in range(threads)]
    for fn in fns:
        fn()   # warm: pages touched, caches of each call's Python filled
    best = float("inf")
    for _ in range(repeat):
        start = threading.Barrier(threads + 1)
        spent = [0.0] * threads

        def run(i: int, start: threading.Barrier, spent: list[float]) -> None:
            fn = fns[i]
            start.wait()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            spent[i] = time.perf_counter() - t0

        workers = [threading.Thread(target=run, args=(i, start, spent)) for i in range(threads)]
        for w in workers:
            w.start()
        start.wait()
        for w in workers:
            w.join()
        best = min(best, max(spent) / calls)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kib", default="64,512", help="destination sizes (KiB, comma-separated)")
    ap.add_argument("--threads", default="1,2", help="thread counts (comma-separated)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per figure (the best is kept)")
    ap.add_argument("--only", default="", help="only kernels whose name contains this")
    ap.add_argument("--out", help="also append the results as JSON lines to this file")
    args = ap.parse_args()
    sizes = [int(k) << 10 for k in args.kib.split(",") if k]
    counts = [int(t) for t in args.threads.split(",") if t]
    lines: list[dict[str, Any]] = []
    for nbytes in sizes:
        one: dict[str, float] = {}   # kernel -> seconds per call with the first thread count
        for threads in counts:
            copy = timed(memcpy(nbytes), threads, args.calls, args.repeat)
            for name, make in cases(nbytes).items():
                if args.only not in name:
                    continue
                t = timed(make, threads, args.calls, args.repeat)
                if threads == counts[0]:
                    one[name] = t
                line = {"kernel": name, "kib": nbytes >> 10, "threads": threads, "us_per_call": round(t * 1e6, 2),
                        "GBps": round(threads * nbytes / t / 1e9, 2), "memcpy_us": round(copy * 1e6, 2),
                        "ratio_to_memcpy": round(copy / t, 3)}
                if threads != counts[0] and name in one:
                    line["speedup_vs_one_thread"] = round(threads * one[name] / t / counts[0], 2)
                lines.append(line)
                print(json.dumps(line), flush=True)
    write_lines(args.out, lines, append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
