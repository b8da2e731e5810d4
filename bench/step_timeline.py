"""One SyncDataParallel step as torch.profiler sees it, drawn as a timeline.

    .venv/bin/python bench/step_timeline.py                 # docs/img/step-timeline.png
    .venv/bin/python bench/step_timeline.py --workers 4 --hidden 2048 --out /tmp/step.png

A local cluster (controller and two memory servers on loopback), ``--workers`` worker
threads in this process, each training an MLP with batch norm through
:class:`~smb_client.torch.SyncDataParallel` (the default collective exchange, gradients
pushed from backward hooks, buffers broadcast). Rank 0 trains under
``torch.profiler``; the script marks its own phases (``step``, ``forward``,
``backward``, ``optimizer``) with ``record_function``, and the torch wing marks every
memory-box wait (``smb::sync.push``, ``smb::sync.sum``, ``smb::sync.barrier``). The
ranges of rank 0's thread in one step (``--step``, after warm-up) are drawn one row
each, in milliseconds from the step's start; the title gives the step's breakdown from
``dp.times.last``.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402

ROWS = ("step", "forward", "backward", "smb::sync.sum", "smb::sync.push", "smb::sync.barrier", "optimizer")
COLORS = {"step": "#bbbbbb", "forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2",
          "smb::sync.sum": "#c44e52", "smb::sync.push": "#dd8452", "smb::sync.barrier": "#937860"}


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def train(store: ParameterStore, rank: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """``args.steps`` steps of one worker; rank 0's under the profiler."""
    model = store.flat.model
    dp = SyncDataParallel(store, rank, args.workers, check_env=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)

    def steps() -> None:
        for step in range(args.steps):
            x, y = torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
            with record_function("step"):
                opt.zero_grad()
                with record_function("forward"):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                with record_function("backward"):
                    loss.backward()                  # ends with the step's exchange (overlap=True)
                with record_function("optimizer"):
                    opt.step()
            if rank == 0 and step == args.step:
                out["times"] = dict(dp.times.last)
    try:
        if rank == 0:
            out["thread"] = threading.get_native_id()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps()
            out["events"] = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()
                             if e.name in ROWS]
        else:
            steps()
    finally:
        dp.close()


def one_step(events: list[tuple[str, float, float, int]], index: int) -> dict[str, list[tuple[float, float]]]:
    """The ranges of the ``index``-th ``step`` range's thread inside it, in ms from its start."""
    step_ranges = sorted(e for e in events if e[0] == "step")
    _, lo, hi, thread = step_ranges[index]
    rows: dict[str, list[tuple[float, float]]] = {r: [] for r in ROWS}
    for name, start, end, tid in events:
        if tid == thread and lo <= start and end <= hi:
            rows[name].append(((start - lo) / 1e3, (end - start) / 1e3))
    return rows


def draw(rows: dict[str, list[tuple[float, float]]], times: dict[str, float], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [r for r in ROWS if rows[r]]
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(shown) + 1.6))
    for i, name in enumerate(shown):
        ax.broken_barh(rows[name], (i - 0.35, 0.7), color=COLORS[name])
        for start, width in rows[name]:
            if width > 0.04 * rows["step"][0][1]:
                ax.text(start + width / 2, i, f"{width:.1f}", ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(len(shown)), shown)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the start of the step")
    ax.set_xlim(0, rows["step"][0][1] * 1.01)
    ax.grid(axis="x", alpha=0.3)
    ms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
    ax.set_title(f"One SyncDataParallel step of rank 0 of {args.workers} (torch.profiler ranges)\n"
                 f"dp.times.last: {ms}", fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers")
    p.add_argument("--batch", type=int, default=64, help="samples per worker and step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--step", type=int, default=4, help="which step to draw (0-based; after warm-up)")
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "step-timeline.png"))
    args = p.parse_args()
    if not 0 <= args.step < args.steps:
        p.error("--step must lie in 0 .. --steps - 1")
    torch.set_num_threads(2)
    out: dict[str, Any] = {}
    errors: list[BaseException] = []
    with LocalCluster(servers=2, capacity="512M", log_level="WARNING") as cluster, cluster.client() as client:
        store0 = ParameterStore.create(client, "bench/step-timeline", make_model(args.hidden),
                                       workers=args.workers, replace=True)
        try:
            def worker(rank: int) -> None:
                try:
                    if rank == 0:
                        train(store0, 0, args, out)
                        return
                    with cluster.client() as c:
                        store = ParameterStore.attach(c, "bench/step-timeline", make_model(args.hidden))
                        try:
                            train(store, rank, args, out)
                        finally:
                            store.close()
                except BaseException as exc:
                    errors.append(exc)
                    raise
            threads = [threading.Thread(target=worker, args=(r,), name=f"rank{r}") for r in range(1, args.workers)]
            for t in threads:
                t.start()
            try:
                worker(0)                  # the profiler on the main thread, where it starts cleanly
            finally:
                for t in threads:
                    t.join()
        finally:
            store0.destroy()
    if errors:
        raise errors[0]
    rows = one_step(out["events"], args.step)
    draw(rows, out["times"], args)
    for name in ROWS:
        if rows[name]:
            print(f"{name:20s} " + "  ".join(f"{s:7.2f}+{w:.2f}" for s, w in rows[name]))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
