"""``python -m bench.cluster``: run the cluster experiments and write their report.

Results go to ``bench/results/cluster.json`` and ``.md`` and to
``docs/img/cluster-*.png``; the tables are pasted into ``docs/benchmarks.md``.
Needs root (network namespaces); exits with status 2 and the reason otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import sys
import time
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from . import experiments, netns, report
from .testbed import ROOT, cleanup

log = logging.getLogger(__name__)

EXPERIMENTS = ("bandwidth", "sharding", "allreduce", "mixed", "failure", "replication", "training", "weights")


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)   # unwinds through the testbeds' teardown


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mbit", type=float, default=None,
                    help=f"link cap in Mbit/s, each direction (default {experiments.Settings.cap_mbit:g}; "
                         f"quick: {experiments.QUICK.cap_mbit:g}; 0: no cap)")
    ap.add_argument("--quick", action="store_true", help="the short version (small sizes, 2 servers, 2 workers)")
    ap.add_argument("--only", default=",".join(EXPERIMENTS),
                    help="comma-separated subset of " + ", ".join(EXPERIMENTS))
    ap.add_argument("--clients", type=int, help="clients of the bandwidth experiment")
    ap.add_argument("--seconds", type=float, help="seconds per bandwidth point and direction")
    ap.add_argument("--replicas", type=int,
                    help="copies of the parameter store in the replication experiment (default "
                         f"{experiments.Settings.repl_replicas}; 1 shows what a kill does without replicas)")
    d = experiments.Settings
    ap.add_argument("--sizes", help="aggregation gradient sizes in MB, comma-separated (default "
                    + ",".join(f"{x / 1e6:g}" for x in d.sync_sizes) + ")")
    ap.add_argument("--dedicated", help="aggregation with dedicated servers: workers x servers, comma-separated "
                    "(default " + ",".join(f"{w}x{k}" for w, k in d.sync_dedicated) + "; 'none': skip)")
    ap.add_argument("--mixed", help="mixed aggregation points: workers x servers x co-located, comma-separated "
                    "(default " + ",".join("x".join(map(str, m)) for m in d.sync_mixed) + ")")
    ap.add_argument("--out", help="JSON results (default bench/results/cluster.json, "
                                   "with --quick cluster-quick.json); when it exists and only some "
                                   "experiments run, theirs replace the earlier ones and the rest is kept")
    ap.add_argument("--png-dir", help="where the cluster-*.png plots go (default docs/img; "
                                      "with --quick none unless given)")
    ap.add_argument("--log-level", default="WARNING", help="of this process and the daemons")
    ap.add_argument("--from-json", metavar="PATH",
                    help="only write the tables and plots again from an earlier results file")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove namespaces and work directories left by runs that are no longer alive, then exit")
    ap.add_argument("--force", action="store_true", help="with --cleanup: also those of live runs")
    return ap.parse_args(argv)


def settings_from(args: argparse.Namespace) -> experiments.Settings:
    s = experiments.QUICK if args.quick else experiments.Settings()
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = set(only) - set(EXPERIMENTS)
    if unknown:
        raise SystemExit(f"unknown experiment(s) {', '.join(sorted(unknown))}: expected {', '.join(EXPERIMENTS)}")
    changes: dict[str, Any] = {"only": only, "log_level": args.log_level.upper()}
    if args.cap_mbit is not None:
        changes["cap_mbit"] = args.cap_mbit
    if args.clients:
        changes["clients"] = args.clients
    if args.seconds:
        changes["seconds"] = args.seconds
    if args.replicas:
        changes["repl_replicas"] = args.replicas
    if args.sizes:
        changes["sync_sizes"] = tuple(int(float(x) * 1e6) for x in args.sizes.split(","))
    if args.dedicated:
        changes["sync_dedicated"] = () if args.dedicated == "none" else tuple(
            tuple(int(v) for v in x.split("x")) for x in args.dedicated.split(","))
    if args.mixed:
        changes["sync_mixed"] = tuple(tuple(int(v) for v in x.split("x")) for x in args.mixed.split(","))
    return replace(s, **changes)


def merge(results: dict[str, Any], out: str) -> dict[str, Any]:
    """``results`` of some experiments merged into the earlier results file ``out``: the
    experiments run now replace theirs, the others stay (with the settings and machine
    of their run under ``runs``)."""
    ran = [name for name in EXPERIMENTS if name in results]
    try:
        with open(out) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return results
    if set(ran) >= {name for name in EXPERIMENTS if name in old}:
        return results
    meta = {k: results[k] for k in ("settings", "host", "kernel", "cpus", "python", "seconds") if k in results}
    runs = old.setdefault("runs", {})
    for name in ran:
        old[name] = results[name]
        runs[name] = meta
    old.setdefault("settings", dict(results.get("settings", {})))["only"] = \
        [name for name in EXPERIMENTS if name in old]
    log.warning("merged %s into the earlier results in %s", ", ".join(ran), out)
    return old


def write_report(results: dict[str, Any], out: str, png_dir: str | None,
                 only: tuple[str, ...] | None = None) -> list[str]:
    """The Markdown tables next to ``out`` (``.md``) and the plots (of the experiments
    in ``only``, default all); prints the tables."""
    table = report.markdown(results)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    pngs = report.plots(results, png_dir, only=only) if png_dir else []
    print(table)
    for line in report.targets(results):
        print(line)
    return pngs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        write_report(results, args.from_json, args.png_dir)
        return 0
    # before the first namespace (the probe's): a stop signal from then on ends the run
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    # Ctrl-C interrupts the run (and tears the testbed down) even where it was started with
    # SIGINT ignored, as a shell does for a background job: Python then installs no handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reason = netns.unavailable_reason()
    if reason:
        print(f"bench.cluster: cannot build the testbed: {reason}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup(force=args.force)
        print(f"removed {len(removed)} leftover(s)" + (": " + " ".join(removed) if removed else ""))
        return 0
    leftovers = cleanup()
    if leftovers:
        log.warning("removed %d leftovers of earlier runs: %s", len(leftovers), " ".join(leftovers))
    s = settings_from(args)
    out = args.out or str(ROOT / "bench/results" / ("cluster-quick.json" if args.quick else "cluster.json"))
    png_dir = args.png_dir or (None if args.quick else str(ROOT / "docs/img"))
    t0 = time.monotonic()
    bar = tqdm(total=experiments.points(s), desc="cluster", unit="point")

    def tick(message: str) -> None:
        bar.write(f"[{time.monotonic() - t0:6.1f} s] {message}")
        bar.update()
    try:
        results = experiments.run_all(s, tick)
    finally:
        bar.close()
    results.update(host=platform.node(), kernel=platform.release(), cpus=os.cpu_count(),
                   python=platform.python_version(), seconds=time.monotonic() - t0)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results = merge(results, out)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    pngs = write_report(results, out, png_dir, only=s.only)
    print(f"results: {out}; plots: {', '.join(pngs) or 'none'}; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
