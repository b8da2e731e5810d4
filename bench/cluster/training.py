"""The training experiment: synchronous data-parallel training, memory box against
``DistributedDataParallel`` (gloo), on the same hosts and capped links.

``s.train_workers`` workers and ``s.train_servers`` memory servers, each on a host of
its own; the workers run :mod:`.training_worker` (every system in turn, in one
process). Per system: steps/s over the timed steps of the slowest worker, its time
waiting for the exchange, CPU cores the testbed used, whether all workers ended with
the same weights, and where the collective's chunks were (bytes per server). Link
bounds per step: the ring moves ``2(n-1)/n`` of the gradient over every link, the
memory box ``max(1, n/k)`` over the busiest (:func:`smb_protocol.placement.host_loads`).
"""
from __future__ import annotations

import statistics
from typing import Any

from .cpuload import CpuSampler
from .testbed import Testbed
from .training_worker import SYSTEMS

MASTER_PORT = 29500


def run(s: Any, tick: Any, cpu: CpuSampler | None = None) -> dict[str, Any]:
    n, k = s.train_workers, s.train_servers
    layers = list(s.train_layers)
    params = sum(a * b + b for a, b in zip(layers, layers[1:], strict=False))
    grad_bytes = 4 * params
    out: dict[str, Any] = {"workers": n, "servers": k, "layers": layers, "parameters": params,
                           "gradient_bytes": grad_bytes, "batch": s.train_batch, "steps": s.train_steps,
                           "warmup": s.train_warmup, "link_MBps": s.cap_mbit / 8, "systems": {}}
    link = s.cap_mbit / 8 * 1e6 if s.cap_mbit else 0.0
    out["link_bound_step_seconds"] = {   # seconds per step the links allow, exchange only
        "ring": 2 * (n - 1) / n * grad_bytes / link if link else None,
        "memory box": max(1.0, n / k) * grad_bytes / link if link else None}
    capacity = f"{max(256, (6 * grad_bytes) // k // (1 << 20) + 64)}M"
    with Testbed(k, n, colocate=False, cap_mbit=s.cap_mbit, log_level=s.log_level, capacity=capacity) as tb:
        specs = [{"mode": "training", "rank": r, "world": n, "layers": layers, "batch": s.train_batch,
                  "steps": s.train_steps, "warmup": s.train_warmup, "lr": 0.01, "systems": list(SYSTEMS),
                  "master": tb.workers[0].address, "master_port": MASTER_PORT, "tag": "train",
                  "log_level": s.log_level} for r in range(n)]
        runs = tb.run_workers(specs, name="train-", timeout=s.train_timeout)
    for system in SYSTEMS:
        seconds = max(r[system]["seconds"] for r in runs)
        comm = [r[system]["comm_wait"] for r in runs if r[system]["comm_wait"] is not None]
        per_step = [max(r[system]["step_ends"][i] for r in runs) for i in range(s.train_steps)]
        steps = [b - a for a, b in zip([0.0, *per_step], per_step, strict=False)]
        out["systems"][system] = {
            "steps_per_second": s.train_steps / seconds, "seconds": seconds,
            "median_step_seconds": statistics.median(steps),
            "comm_wait_per_step": (max(comm) / s.train_steps) if comm else None,
            "cpu": cpu.usage(max(r[system]["window"][0] for r in runs),
                             min(r[system]["window"][1] for r in runs)) if cpu else None,
            "same_weights": all(r[system]["same_weights"] for r in runs),
            "chunk_bytes_per_server": runs[0][system]["chunk_bytes_per_server"]}
    ddp = out["systems"]["ddp"]["steps_per_second"]
    for system in SYSTEMS:
        out["systems"][system]["vs_ddp"] = out["systems"][system]["steps_per_second"] / ddp
    tick("training, " + ", ".join(f"{name} {v['steps_per_second']:.2f} steps/s ({v['vs_ddp']:.2f}x DDP)"
                                  for name, v in out["systems"].items()))
    return out


# -- report -------------------------------------------------------------------------
TARGET = 1.3   # memory-box steps/s over DDP's


def table(r: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    lines = ["| system | steps/s | vs DDP | median step (s) | waiting for the exchange per step (s) "
             "| CPU cores used | same weights on every worker |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, v in r["systems"].items():
        comm = "-" if v["comm_wait_per_step"] is None else f"{v['comm_wait_per_step']:.3f}"
        cores = "-" if not v["cpu"] else f"{v['cpu']['cores']:.2f}"
        lines.append(f"| {name} | {v['steps_per_second']:.2f} | {v['vs_ddp']:.2f} | {v['median_step_seconds']:.3f} "
                     f"| {comm} | {cores} | {'yes' if v['same_weights'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def summary(r: dict[str, Any]) -> str:
    b = r["link_bound_step_seconds"]
    bounds = ("" if b["ring"] is None else
              f"; link bound of the exchange per step: ring {b['ring']:.3f} s, memory box {b['memory box']:.3f} s")
    return (f"**Training**: MLP {'-'.join(map(str, r['layers']))} ({r['parameters'] / 1e6:.1f} M parameters, "
            f"{r['gradient_bytes'] / 1e6:.1f} MB of float32 gradients), {r['workers']} workers and "
            f"{r['servers']} memory servers on hosts of their own, batch {r['batch']} per worker, "
            f"{r['steps']} timed steps after {r['warmup']}{bounds}\n")


def targets(r: dict[str, Any]) -> list[str]:
    best = max(v["vs_ddp"] for name, v in r["systems"].items() if name != "ddp")
    ok = all(v["same_weights"] for v in r["systems"].values())
    return [f"training: memory box {best:.2f}x DDP's steps/s (target {TARGET}): "
            f"{'met' if best >= TARGET else 'NOT met'}; same weights on every worker: {'yes' if ok else 'NO'}"]


def plot(r: dict[str, Any], path: str) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(r["systems"])
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.bar(names, [r["systems"][n]["steps_per_second"] for n in names], color=[f"C{i}" for i in range(len(names))])
    b = r["link_bound_step_seconds"]
    if b["ring"]:
        ax.axhline(1 / b["memory box"], color="C0", ls="--", lw=0.8, label="memory box link bound (exchange only)")
        ax.axhline(1 / b["ring"], color="C2", ls="--", lw=0.8, label="ring link bound (exchange only)")
        ax.legend(fontsize=8)
    ax.set_ylabel("steps/s (slowest worker)")
    ax.set_title(f"synchronous training, {r['workers']} workers, {r['servers']} dedicated memory servers, "
                 f"{r['gradient_bytes'] / 1e6:.0f} MB gradients", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
