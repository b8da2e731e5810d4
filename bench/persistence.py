"""What persistence costs on the data path: persistent against memory-only regions,
measured in the same run.

    .venv/bin/python bench/persistence.py            # make bench
    .venv/bin/python bench/persistence.py --quick    # fewer sizes, shorter points

A local cluster (controller + one memory server, separate processes on loopback) whose
server has a data directory, so a ``persistent=True`` region lives in a memfd that the
server hands to its keeper (``smb_server.memserver.keeper``) and writes back to a file
every ``writeback_seconds`` (10 s, the default). For every operation size, on a
memory-only and on a persistent region of one server:

* ``Region.write`` over tcp and through shm;
* ``Region.accumulate`` of float32 over tcp (shm sends it to the server too).

Each point is the best of ``--repeats`` runs, each at least ``--seconds`` long, the two
kinds in turns; the ratio persistent / memory-only is reported (1.0: no cost). Results go to
``bench/results/persistence.json`` and a Markdown table in
``bench/results/persistence.md``.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.throughput import arguments, machine, run, save  # noqa: E402
from smb_client.region import Region  # noqa: E402
from smb_protocol.units import format_bytes  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]
QUICK_SIZES = [4 * KiB, MiB, 16 * MiB]
KINDS = ("memory-only", "persistent")
SERIES = (("write", "tcp"), ("write", "shm"), ("accumulate", "tcp"))


def operation(op: str, region: Region, data: np.ndarray) -> Callable[[], None]:
    if op == "write":
        return lambda: region.write(0, data)
    return lambda: region.accumulate(0, data)


def measure(sizes: list[int], seconds: float, repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    """MB/s by series ("write tcp"), kind and size: the best of ``repeats`` runs, the two
    kinds in turns (each first every other time) so that both see the same load."""
    src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    grads = np.random.default_rng(1).standard_normal(max(sizes) // 4).astype(np.float32)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    capacity = f"{4 * max(sizes) // MiB + 64}M"
    with LocalCluster(servers=1, capacity=capacity, persistent=True, log_level="WARNING") as cluster:
        with cluster.client() as admin:
            for kind in KINDS:
                admin.create_region(f"bench/{kind}", max(sizes), placement="single",
                                    persistent=kind == "persistent").close()
        for op, transport in SERIES:
            with cluster.client(transport=transport) as c:
                regions = {kind: c.open_region(f"bench/{kind}") for kind in KINDS}
                for size in sizes:
                    data = src[:size] if op == "write" else grads[:size // 4]
                    fns = {kind: operation(op, r, data) for kind, r in regions.items()}
                    best = dict.fromkeys(KINDS, 0.0)
                    for fn in fns.values():
                        fn()                     # warm up: connections, page faults
                    for i in range(repeats):          # in turns, each kind first every other time
                        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                            best[kind] = max(best[kind], run(fns[kind], size, seconds))
                    for kind in KINDS:
                        rows.setdefault(f"{op} {transport}", {}).setdefault(kind, {})[str(size)] = best[kind]
                    print(f"{op:10s} {transport} {format_bytes(size):>8s}: "
                          + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in best.items()), flush=True)
                for r in regions.values():
                    r.close()
    return rows


def markdown(rows: dict[str, dict[str, dict[str, float]]], sizes: list[int]) -> str:
    lines = ["| operation | size | memory-only MB/s | persistent MB/s | persistent / memory-only |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for series, by_kind in rows.items():
        for size in sizes:
            mem, per = by_kind["memory-only"][str(size)], by_kind["persistent"][str(size)]
            lines.append(f"| {series} | {format_bytes(size)} | {mem:,.0f} | {per:,.0f} | {per / mem:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = arguments(__doc__.split("\n")[0], "persistence")
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    seconds = 0.2 if args.quick else args.seconds
    repeats = 2 if args.quick else args.repeats
    rows = measure(sizes, seconds, repeats)
    table = markdown(rows, sizes)
    save({**machine(), "sizes": sizes, "seconds": seconds, "repeats": repeats, "MBps": rows}, table, args.out)
    print(table)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
