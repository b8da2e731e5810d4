"""The cost of replication: replicated regions against unreplicated ones, same run.

    .venv/bin/python bench/replication.py            # make bench
    .venv/bin/python bench/replication.py --quick    # fewer sizes, shorter points

A local cluster (controller + two memory servers, separate processes on loopback) and
two regions striped over both servers with a 1 MiB stripe unit: one with
``replicas=1`` and one with ``replicas=2`` (every stripe on both servers; each server is
the primary of half the stripes and the backup of the other half). For every operation
size: ``Region.write``, ``Region.accumulate`` (float32) and ``Region.read_into`` over
tcp, on both regions; the ratio replicated / unreplicated is the cost of replication.

A replicated mutation goes to the primary, which applies it and forwards it to the
backup before it answers, so every byte crosses loopback twice and is applied twice
on one machine's memory bandwidth and cores: the target is at least 0.45 of the
unreplicated throughput for write and accumulate, and reads unchanged (at least 0.9;
a read is served by one copy).

Each point is the best of ``--repeats`` runs, each at least ``--seconds`` long (MB/s,
1e6 bytes). Results go to ``bench/results/replication.json`` and ``.md`` and to
``docs/img/replication.png``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tqdm import tqdm  # noqa: E402

from bench.throughput import arguments, machine, save, timed  # noqa: E402
from smb_protocol.units import format_bytes  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [MiB, 16 * MiB]
OPS = ("write", "accumulate", "read")
TARGETS = {"write": 0.45, "accumulate": 0.45, "read": 0.9}   # replicated / unreplicated
TARGET_SIZE = 16 * MiB


def measure(sizes: list[int], seconds: float, repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    """MB/s by series (``replicas=1``, ``replicas=2``), operation and size."""
    top = max(sizes)
    src = np.random.default_rng(0).standard_normal(top // 4).astype(np.float32)
    dst = np.empty_like(src)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    bar = tqdm(total=len(sizes) * 2 * len(OPS), desc="replication", unit="point")
    try:
        with LocalCluster(servers=2, capacity=f"{4 * top // MiB + 64}M", log_level="WARNING") as cluster, \
                cluster.client(transport="tcp") as c:
            for replicas in (1, 2):
                series = f"replicas={replicas}"
                r = c.create_region(f"bench/replicas-{replicas}", top, stripe_unit=MiB, replicas=replicas)
                try:
                    for size in sizes:
                        n = size // 4
                        bar.set_postfix_str(f"{series} {format_bytes(size)}")
                        fns = {"write": lambda n=n, r=r: r.write(0, src[:n]),
                               "accumulate": lambda n=n, r=r: r.accumulate(0, src[:n]),
                               "read": lambda n=n, r=r: r.read_into(0, dst[:n])}
                        for op in OPS:
                            rows.setdefault(series, {}).setdefault(op, {})[str(size)] = \
                                timed(fns[op], size, seconds, repeats)
                            bar.update()
                finally:
                    r.close()
                    c.delete_region(r.name)
    finally:
        bar.close()
    return rows


def ratios(rows: dict[str, dict[str, dict[str, float]]], sizes: list[int]) -> dict[str, dict[str, float]]:
    """replicated / unreplicated throughput by operation and size."""
    one, two = rows["replicas=1"], rows["replicas=2"]
    return {op: {str(s): two[op][str(s)] / one[op][str(s)] for s in sizes} for op in OPS}


def markdown(rows: dict[str, dict[str, dict[str, float]]], sizes: list[int],
             ratio: dict[str, dict[str, float]]) -> str:
    lines = ["| size | op | replicas=1 MB/s | replicas=2 MB/s | ratio | target |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for s in sizes:
        for op in OPS:
            lines.append(f"| {format_bytes(s)} | {op} | {rows['replicas=1'][op][str(s)]:.0f} | "
                         f"{rows['replicas=2'][op][str(s)]:.0f} | {ratio[op][str(s)]:.2f} | "
                         f"{TARGETS[op]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(ratio: dict[str, dict[str, float]], sizes: list[int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for op in OPS:
        ax.plot(sizes, [ratio[op][str(s)] for s in sizes], marker="o", label=op)
        ax.axhline(TARGETS[op], ls=":", lw=1, color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_bytes(s) for s in sizes])
    ax.set_ylim(0, 1.3)
    ax.set_xlabel("operation size")
    ax.set_ylabel("replicas=2 / replicas=1 throughput")
    ax.set_title("cost of replication over tcp on loopback (dotted: targets)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = arguments(__doc__.split("\n")[0], "replication")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs/img/replication.png"))
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    seconds = 0.2 if args.quick else args.seconds
    rows = measure(sizes, seconds, args.repeats)
    ratio = ratios(rows, sizes)
    result = {**machine(), "sizes": sizes, "seconds": seconds, "repeats": args.repeats, "MBps": rows,
              "ratio": ratio, "targets": TARGETS}
    table = markdown(rows, sizes, ratio)
    save(result, table, args.out)
    plot(ratio, sizes, args.png)
    print(table)
    print(f"results: {args.out}, plot: {args.png}")
    at = str(TARGET_SIZE) if str(TARGET_SIZE) in ratio["write"] else str(sizes[-1])
    met = all(ratio[op][at] >= TARGETS[op] for op in OPS)
    print(f"targets at {format_bytes(int(at))}:", "met" if met else "NOT all met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
