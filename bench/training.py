"""Training throughput and time-to-accuracy: the memory box's schemes vs DDP (gloo).

    .venv/bin/python bench/training.py                 # 4 workers, 20 epochs
    .venv/bin/python bench/training.py --epochs 10     # shorter
    .venv/bin/python bench/training.py --hidden 1024 --epochs 4 --only "smb sync + hooks,smb sync" \
        --name training-wide                           # a wider model: overlap with and without

One local cluster (controller + two memory servers on loopback), the digits MLP of
:mod:`smb_train.digits` (64-256-256-10, 85k parameters), the same workers,
batches, optimizer and data in every configuration, each launched with torchrun:

* ``smb sync + hooks``: :class:`SyncDataParallel`, gradients pushed from backward hooks;
* ``smb sync``: the same, one push after backward (no overlap);
* ``ddp (gloo)``: ``DistributedDataParallel`` over gloo, the reference;
* ``smb seasgd``: asynchronous elastic averaging, update interval 4;
* ``smb hybrid``: 2 nodes × 2 workers (gloo inside, SEASGD across).

Samples/s counts the samples of all workers over the slowest worker's training time
(process start-up excluded); time-to-accuracy is when the master's evaluation (after each
of its epochs; the global weights for the asynchronous schemes) first reaches 0.95 test
accuracy. Ratios are against DDP measured in the same run. Results go to
``bench/results/<name>.json``, ``bench/results/<name>.md`` and ``docs/img/<name>.png``
(``--name``, default ``training``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from smb_protocol.units import format_bytes  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402
from smb_train import digits as td  # noqa: E402

CONFIGS = [  # label, scheme, extra worker options
    ("smb sync + hooks", "sync", []),
    ("smb sync", "sync", ["--no-overlap"]),
    ("ddp (gloo)", "ddp", []),
    ("smb seasgd", "seasgd", []),
    ("smb hybrid", "hybrid", []),
]
REFERENCE = "ddp (gloo)"


def markdown(rows: list[dict], workers: int, epochs: int) -> str:
    ref = next(r for r in rows if r["label"] == REFERENCE)
    lines = [f"| configuration | samples/s | vs DDP | test accuracy | time to {td.TARGET_ACCURACY} (s) | "
             "vs DDP | train time (s) | bytes moved |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        tta, ref_tta = r["time_to_accuracy"], ref["time_to_accuracy"]
        tta_s = "not reached" if tta is None else f"{tta:.2f}"
        tta_ratio = "-" if tta is None or ref_tta is None else f"{tta / ref_tta:.2f}"
        moved = format_bytes(r["bytes_moved"]) + (" (ring estimate)" if r["estimated_bytes"] else "")
        lines.append(f"| {r['label']} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / ref['samples_per_s']:.2f} | "
                     f"{r['accuracy']:.3f} | {tta_s} | {tta_ratio} | {r['time']:.2f} | {moved} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["label"] for r in rows]
    ax1.barh(labels, [r["samples_per_s"] for r in rows],
             color=["tab:gray" if r["label"] == REFERENCE else "tab:blue" for r in rows])
    ax1.invert_yaxis()
    ax1.set_xlabel("samples/s (all workers)")
    ax1.set_title("throughput")
    for r in rows:
        curve = r["curve"]
        ax2.plot([c[0] for c in curve], [c[2] for c in curve], marker=".", label=r["label"])
    ax2.axhline(td.TARGET_ACCURACY, color="k", lw=0.8, ls="--")
    ax2.set_xlabel("training time (s)")
    ax2.set_ylabel("test accuracy")
    ax2.set_ylim(0.5, 1.0)
    ax2.set_title("time to accuracy")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--placement", default="striped", choices=("striped", "layered"))
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (256: the demo's model)")
    parser.add_argument("--only", default="", help="comma-separated configurations to run (default all; "
                        "the DDP reference always runs)")
    parser.add_argument("--name", default="training", help="file stem for the JSON, Markdown and PNG")
    args = parser.parse_args()
    wargs = td.build_parser().parse_args(["--epochs", str(args.epochs), "--placement", args.placement,
                                          "--hidden", str(args.hidden), "--quiet", "--job", "bench"])
    wanted = {x.strip() for x in args.only.split(",") if x.strip()}
    configs = [c for c in CONFIGS if not wanted or c[0] in wanted or c[0] == REFERENCE]
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    png = ROOT / "docs" / "img" / f"{args.name}.png"
    rows = []
    with LocalCluster(servers=2, capacity="512M", log_level="WARNING") as cluster, \
            tempfile.TemporaryDirectory(prefix="smb-bench-train-") as tmp:
        data = str(Path(tmp) / "digits.npz")
        td.save_data(data)
        env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for label, scheme, extra in tqdm(configs, desc="configurations", unit="run"):
            row = td.run_scheme(scheme, args.workers, td.worker_argv(wargs, data) + extra, env)
            row["label"] = label
            rows.append(row)
            tqdm.write(f"{label:18s} {row['samples_per_s']:9,.0f} samples/s  accuracy {row['accuracy']:.3f}  "
                       f"time to {td.TARGET_ACCURACY}: {row['time_to_accuracy']}")
    table = markdown(rows, args.workers, args.epochs)
    print("\n" + table)
    meta = {"workers": args.workers, "epochs": args.epochs, "placement": args.placement, "batch": wargs.batch,
            "hidden": wargs.hidden, "lr": wargs.lr, "momentum": wargs.momentum, "interval": wargs.interval,
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table)
    plot(rows, png)
    print(f"wrote {out}, {out.with_suffix('.md')} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
