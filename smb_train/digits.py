"""Train a small network on scikit-learn's bundled digits through the memory box.

Three update schemes (and torch DistributedDataParallel as a reference):

* ``sync``: gradients accumulated in the memory box, a barrier, averaged gradients
  pulled (:class:`smb_client.torch.SyncDataParallel`);
* ``seasgd``: asynchronous elastic averaging, a global weight buffer and a private
  delta slot per worker (:class:`smb_client.torch.SEASGD`);
* ``hybrid``: gloo all-reduce inside a node, SEASGD across nodes
  (:class:`smb_client.torch.HybridSEASGD`);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, no memory box.

Two ways to run it:

    # launcher: starts a local cluster (unless --controller), then torchrun per scheme
    smb train --workers 4 --scheme sync
    python -m smb_train.digits --workers 4 --scheme all

    # one worker of a torchrun job against a running cluster (SMB_CONTROLLER, SMB_TOKEN)
    torchrun --nproc-per-node 4 -m smb_train.digits --scheme sync

Under torchrun rank 0 creates the regions and the others attach by name.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .workers import ALL_SCHEMES, SCHEMES, TARGET_ACCURACY, run_worker, save_data

log = logging.getLogger(__name__)
#: this module's import name, also when it runs as ``python -m`` (``__name__`` is then
#: ``__main__``, which torchrun cannot import in its workers)
MODULE = __spec__.name if __spec__ is not None else __name__


def time_to_accuracy(curve: list[list[float]], target: float) -> float | None:
    for elapsed, _samples, acc in curve:
        if acc >= target:
            return elapsed
    return None


def summarize(scheme: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the per-rank results of one scheme."""
    parts = sorted(parts, key=lambda r: r["rank"])
    master = parts[0]
    elapsed = max(r["time"] for r in parts)
    samples = sum(r["samples"] for r in parts)
    moved = sum(r["traffic"]["sent"] + r["traffic"]["received"] for r in parts)
    return {"scheme": scheme, "workers": len(parts), "time": elapsed, "samples": samples,
            "samples_per_s": samples / elapsed if elapsed else 0.0, "accuracy": master["accuracy"],
            "bytes_moved": moved, "estimated_bytes": bool(master["traffic"].get("estimated")),
            "time_to_accuracy": time_to_accuracy(master["curve"], TARGET_ACCURACY),
            "curve": master["curve"], "steps": [r["steps"] for r in parts],
            "overlap": master.get("overlap")}


def run_scheme(scheme: str, workers: int, worker_args: list[str], env: dict[str, str],
               timeout: float = 600.0, max_restarts: int = 0) -> dict[str, Any]:
    """Run one scheme under torchrun with ``workers`` processes (started again up to
    ``max_restarts`` times after one dies); returns its summary."""
    with tempfile.TemporaryDirectory(prefix="smb-train-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={workers}", f"--max-restarts={max_restarts}", "-m", MODULE,
               "--scheme", scheme, "--result-dir", out, *worker_args]
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"smb train: {scheme} workers failed (exit {proc.returncode})")
        parts = [json.loads(p.read_text()) for p in sorted(Path(out).glob(f"{scheme}-rank*.json"))]
    if len(parts) != workers:
        raise SystemExit(f"smb train: {scheme}: {len(parts)} of {workers} workers reported")
    return summarize(scheme, parts)


def format_table(rows: list[dict[str, Any]]) -> str:
    from smb_protocol.units import format_bytes
    head = ["scheme", "workers", "time (s)", "samples/s", "test accuracy", f"time to {TARGET_ACCURACY:.2f} (s)",
            "bytes moved"]
    lines = [head]
    for r in rows:
        tta = r["time_to_accuracy"]
        moved = format_bytes(r["bytes_moved"]) + (" (est.)" if r["estimated_bytes"] else "")
        lines.append([r["label"] if "label" in r else r["scheme"], str(r["workers"]), f"{r['time']:.2f}",
                      f"{r['samples_per_s']:,.0f}", f"{r['accuracy']:.3f}",
                      "-" if tta is None else f"{tta:.2f}", moved])
    widths = [max(len(x) for x in col) for col in zip(*lines, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def worker_argv(args: argparse.Namespace, data: str) -> list[str]:
    out = ["--data", data, "--job", args.job, "--epochs", str(args.epochs), "--batch", str(args.batch),
           "--lr", str(args.lr), "--momentum", str(args.momentum), "--hidden", str(args.hidden),
           "--seed", str(args.seed), "--placement", args.placement, "--interval", str(args.interval),
           "--stop-rule", args.stop_rule, "--node-size", str(args.node_size)]
    if args.moving_rate is not None:
        out += ["--moving-rate", str(args.moving_rate)]
    if args.replicas != 1:
        out += ["--replicas", str(args.replicas)]
    if args.eval_every:
        out += ["--eval-every", str(args.eval_every)]
    if args.no_overlap:
        out.append("--no-overlap")
    if args.compression:
        out += ["--compression", args.compression]
    if args.quiet:
        out.append("--quiet")
    return out


def clear_job(controller: str, token: str, job: str, replace: bool) -> None:
    """Regions under ``job/`` are left over from a run that did not finish: delete them
    when ``replace``, else stop with a message that says what to do."""
    import smb_client
    with smb_client.connect(controller, token=token or None) as client:
        left = [r.name for r in client.list_regions(f"{job}/")]
        if left and not replace:
            raise SystemExit(f"smb train: {len(left)} region(s) under {job}/ exist ({', '.join(left[:3])}"
                             f"{', ...' if len(left) > 3 else ''}), left by a run that did not finish? "
                             "Rerun with --replace to delete them, or choose another --job")
        if left:
            print(f"deleting {len(client.delete_regions(f'{job}/'))} region(s) left under {job}/", flush=True)


def launch(args: argparse.Namespace) -> int:
    from smb_protocol.units import format_bytes
    schemes = list(SCHEMES) if args.scheme == "all" else [args.scheme]
    cluster = None
    controller, token = args.controller, os.environ.get("SMB_TOKEN", "")
    if not controller:
        from smb_server.commands.local_cluster import LocalCluster
        print("starting a local cluster: 1 controller + 2 memory servers ...", flush=True)
        cluster = LocalCluster(servers=2, capacity="512M", log_level="WARNING").start()
        controller, token = cluster.address, cluster.token
    rows = []
    try:
        clear_job(controller, token, args.job, args.replace)
        with tempfile.TemporaryDirectory(prefix="smb-digits-") as tmp:
            data = str(Path(tmp) / "digits.npz")
            save_data(data)
            env = dict(os.environ, SMB_CONTROLLER=controller, SMB_TOKEN=token, OMP_NUM_THREADS="1")
            for scheme in schemes:
                print(f"\n[{scheme}] {args.workers} workers under torchrun, {args.epochs} epochs, "
                      f"{args.placement} parameter store", flush=True)
                row = run_scheme(scheme, args.workers, worker_argv(args, data), env,
                                 max_restarts=args.max_restarts)
                rows.append(row)
                tta = row["time_to_accuracy"]
                print(f"[{scheme}] {row['time']:.2f} s, {row['samples_per_s']:,.0f} samples/s, "
                      f"test accuracy {row['accuracy']:.3f}"
                      + (f" (reached {TARGET_ACCURACY} after {tta:.2f} s)" if tta is not None else "")
                      + f", {format_bytes(row['bytes_moved'])} moved", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    print("\n" + format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.min_accuracy:
        for row in rows:
            if row["scheme"] == "sync" and row["accuracy"] < args.min_accuracy:
                print(f"sync reached only {row['accuracy']:.3f} < {args.min_accuracy}", file=sys.stderr)
                return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smb train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="all", choices=("all",) + ALL_SCHEMES)
    p.add_argument("--workers", type=int, default=4, help="worker processes (launcher)")
    p.add_argument("--controller", default=None,
                   help="controller host:port of a running cluster (launcher; default: a local cluster)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", default="striped", choices=("striped", "layered", "single"))
    p.add_argument("--interval", type=int, default=4, help="SEASGD update interval (steps)")
    p.add_argument("--moving-rate", type=float, default=None, help="SEASGD moving rate (default 0.9/workers)")
    p.add_argument("--stop-rule", default="average", choices=("master", "fastest", "average"),
                   help="when asynchronous workers stop")
    p.add_argument("--node-size", type=int, default=0,
                   help="hybrid: workers per node (default LOCAL_WORLD_SIZE; half the workers on one host)")
    p.add_argument("--no-overlap", action="store_true", help="push gradients after backward, not from hooks")
    p.add_argument("--compression", default=None, choices=("bf16", "fp16", "bf16-full", "fp16-full"),
                   help="sync: gradients as 16-bit values on the wire, summed in float32 on the servers")
    p.add_argument("--job", default="digits", help="region namespace")
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of every byte of the parameter store on distinct memory servers (1 to 3)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="seasgd: rank 0 evaluates the global weights every this many of its steps "
                        "(default 0: after every epoch)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="launcher: torchrun starts the workers again up to this many times after one "
                        "dies; seasgd resumes from the global weights in the memory box")
    p.add_argument("--replace", action="store_true",
                   help="launcher: delete regions left under the job's namespace by an unfinished run")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="launcher: exit 1 if sync ends below this test accuracy")
    p.add_argument("--json", default=None, help="launcher: write the summary rows here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record-steps", action="store_true", help=argparse.SUPPRESS)   # bench.cluster
    p.add_argument("--keep-store", action="store_true", help=argparse.SUPPRESS)     # bench.cluster
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("SMB_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "RANK" in os.environ:   # a torchrun worker
        if args.scheme == "all":
            raise SystemExit("under torchrun pass one --scheme (sync, seasgd, hybrid or ddp)")
        run_worker(args)
        return 0
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
