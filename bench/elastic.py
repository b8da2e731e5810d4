"""The elastic pool under training: a memory server evacuated, then the pool rebalanced
onto a server that joined, while 4 workers train, on the network-namespace testbed
(:mod:`bench.cluster.testbed`; needs root).

    .venv/bin/python -m bench.elastic                  # both schemes, about 6 minutes
    .venv/bin/python -m bench.elastic --quick          # 2 workers, small model, about 1 minute
    .venv/bin/python -m bench.elastic --from-json bench/results/elastic.json   # plots and table again

One testbed per training scheme (``sync``: :class:`SyncDataParallel`; ``seasgd``: the
digits trainer's SEASGD), with 3 memory servers, 2 spare memory-server hosts and 4 worker
hosts, each its own namespace with a capped link. Three training runs of the digits
model on it, the same seed and epochs each time (:mod:`bench.cluster.elastic_worker`):

1. ``undisturbed``: nothing happens;
2. ``evacuate``: after the first step the first spare server joins (empty: the job's
   regions exist already); once the workers are ``--fraction`` of the way through, the
   memory server holding the most bytes of the job is evacuated (``smb server drain
   --evacuate``), then removed (``smb server remove``) and its daemon stopped: the
   replacement of a machine under a running job;
3. ``rebalance``: the job now lives on the 3 servers left; the second spare joins the
   same way (a 4th server) and at the same point ``smb rebalance`` (``--rate``) evens
   the bytes out.

Recorded per run: time and bytes of the move; steps/s per worker before, during and
after it (from every worker's step log) and as a timeline; the final test accuracy
against the undisturbed run's; CPU of the servers, workers and controller and every
link's bytes in each window (where the time goes); the regions' states throughout; and
after training every copy of every slot compared byte for byte, the stored weights
against the workers' (sync) or against the initial weights plus every pushed delta and
the counters against the workers' steps (SEASGD): 0 bytes lost or applied twice.

Results: ``bench/results/elastic.json`` (``--quick``: ``elastic-quick.json``), plots
``docs/img/elastic-evacuate.png`` and ``docs/img/elastic-rebalance.png``.
"""
from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):   # run as a file: bench/elastic.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cluster import links, netns, signal_files  # noqa: E402
from bench.cluster.cpuload import CpuSampler  # noqa: E402
from bench.cluster.testbed import ROOT, Testbed, TestbedError, cleanup, kill_process  # noqa: E402

log = logging.getLogger("bench.elastic")

SCHEMES = ("sync", "seasgd")
RUNS = ("undisturbed", "evacuate", "rebalance")
WARMUP = 1.0          # seconds after the start left out of "before" (connections, first steps)
METRICS_PORT = 0


@dataclass(frozen=True)
class Settings:
    """What a run trains and how the testbed is built."""

    workers: int = 4
    servers: int = 3                 # memory servers the job starts on; 2 spare hosts more
    epochs: int = 15
    batch: int = 32
    hidden: int = 1024               # digits MLP 64-1024-1024-10: 1.13 M parameters, 4.5 MB
    seed: int = 0
    interval: int = 4                # SEASGD update interval (steps)
    lr: float = 0.05
    momentum: float = 0.9
    replicas: int = 2                # copies of every byte of the parameter store
    cap_mbit: float = 500.0          # every link, each direction
    lease_seconds: float = 5.0
    fraction: float = 0.3            # of the target steps, when the move starts
    rate: float = 0.0                # rebalance limit, bytes/s (0: none)
    poll: float = 0.1                # seconds between the mover's looks
    bin_seconds: float = 1.0         # width of a timeline bin
    timeout: float = 300.0           # seconds a training run may take
    schemes: tuple[str, ...] = SCHEMES
    runs: tuple[str, ...] = RUNS     # in this order on one testbed (a test runs fewer)
    log_level: str = "WARNING"       # this process and the workers (the daemons log at INFO)


QUICK = Settings(workers=2, servers=2, epochs=10, hidden=256, cap_mbit=200.0, timeout=150.0, bin_seconds=0.5)


# -- one run ---------------------------------------------------------------------------
def _digits_argv(s: Settings, job: str, data: Path, result_dir: Path) -> list[str]:
    """The digits trainer's SEASGD worker, as the replication experiment runs it."""
    return ["--scheme", "seasgd", "--data", str(data), "--job", job, "--epochs", str(s.epochs),
            "--batch", str(s.batch), "--hidden", str(s.hidden), "--seed", str(s.seed), "--lr", str(s.lr),
            "--momentum", str(s.momentum), "--placement", "striped", "--interval", str(s.interval),
            "--stop-rule", "average", "--replicas", str(s.replicas), "--record-steps", "--keep-store",
            "--quiet", "--result-dir", str(result_dir)]


def target_total(s: Settings, scheme: str, train_size: int) -> int:
    """Steps of all workers together at the end of a run."""
    if scheme == "sync":
        return train_size // (s.workers * s.batch) * s.epochs * s.workers
    per_worker = min(len(range(r, train_size, s.workers)) for r in range(s.workers)) // s.batch
    return per_worker * s.epochs * s.workers


def training_run(tb: Testbed, s: Settings, scheme: str, name: str, spare: int | None, data: Path,
                 train_size: int) -> dict[str, Any]:
    """One run on ``tb``: ``name`` is ``undisturbed``, ``evacuate`` or ``rebalance``; the
    spare memory server ``spare`` joins at the trigger. A failure of the run itself is
    reported under ``error``."""
    world = s.workers
    job = f"el-{scheme}-{name}"
    prefix = f"{job}/{scheme}"
    sig = tb.workdir / job
    results = sig / "results"
    results.mkdir(parents=True, exist_ok=True)
    action = {"undisturbed": "none"}.get(name, name)
    total = target_total(s, scheme, train_size)
    common = {"controller": tb.controller_address, "log_level": s.log_level}
    run: dict[str, Any] = {"job": job, "action": action, "target_total": total, "error": None}
    mover_spec = {**common, "mode": "elastic_mover", "prefix": prefix, "world": world, "target_total": total,
                  "action": action, "fraction": s.fraction, "rate": s.rate, "poll": s.poll,
                  "signal_dir": str(sig), "secret_file": str(tb.workdir / "secret"), "timeout": s.timeout + 60}
    if scheme == "sync":
        wspec = {**common, "mode": "elastic_sync", "world": world, "prefix": prefix, "data": str(data),
                 "batch": s.batch, "hidden": s.hidden, "seed": s.seed, "epochs": s.epochs, "lr": s.lr,
                 "momentum": s.momentum, "replicas": s.replicas, "result_dir": str(results),
                 "action": action, "signal_dir": str(sig)}
    else:
        wspec = {**common, "mode": "train", "world": world, "argv": _digits_argv(s, job, data, results)}
    groups: dict[str, list[str]] = {"servers": [f"srv{i}" for i in range(len(tb.server_info))],
                                    "controller": ["controller"], "workers": []}
    samplers = {g: CpuSampler(lambda g=g: _pids(tb, groups[g])).start() for g in groups}
    t0 = time.monotonic()
    with tb.monitor_links(sig / "links.jsonl", interval=0.1) as hosts:
        mover, mover_out = tb.start_worker(tb.controller, f"{job}-mover", mover_spec)
        workers = [(f"{job}-w{r}", *tb.start_worker(tb.workers[r], f"{job}-w{r}", {**wspec, "rank": r}))
                   for r in range(world)]
        groups["workers"] = [n for n, _, _ in workers]
        joined = removed = False

        def join_remove_mover() -> str | None:
            nonlocal joined, removed
            if not joined and spare is not None and (sig / "join.json").exists():
                info = tb.start_server(spare)
                groups["servers"].append(f"srv{spare}")
                signal_files.write(sig / "joined.json", {"time": time.time(), "server": info["server_id"],
                                                         "host": tb.servers[spare].role})
                joined = True
            if not removed and (sig / "removed.json").exists():
                gone = json.loads((sig / "removed.json").read_text())["server"]
                index = tb.servers.index(tb.server_host(gone))
                try:
                    tb.kill_server(index, signal.SIGTERM)
                except Exception:   # not gone after the grace: as kill -9
                    tb.kill_server(index)
                run["stopped_daemon"] = {"time": time.time(), "host": tb.servers[index].role}
                removed = True
            if mover.poll() not in (None, 0):
                return f"the mover exited with {mover.returncode}:\n{tb.log_tail(f'{job}-mover', 15)}"
            return None
        run["workers"], run["error"] = tb.watch_workers(workers, s.timeout, join_remove_mover, tail=40)
        if run["error"]:
            signal_files.write(sig / "stop.json", {"time": time.time()})
        try:
            run["mover"] = tb.wait_worker(f"{job}-mover", mover, mover_out, timeout=s.timeout)
        except TestbedError as exc:
            run["mover"] = {}
            run["error"] = run["error"] or f"mover: {exc}"
        finally:
            kill_process(mover)
    for sampler in samplers.values():
        sampler.stop()
    ports, _, times, counters = links.load(sig / "links.jsonl")
    run["links"] = {"roles": [h.role for h in hosts], "ports": ports, "times": times, "counters": counters}
    local_steps = [w.get("local_steps", w.get("steps")) for w in sorted(run["workers"], key=lambda w: w["rank"])]
    check_spec = {**common, "mode": "elastic_check", "prefix": prefix, "world": world, "scheme": scheme,
                  "result_dir": str(results), "seed": s.seed, "hidden": s.hidden, "local_steps": local_steps}
    try:
        run["check"] = tb.run_workers([check_spec], hosts=[tb.controller], name=f"{job}-check", timeout=120.0)[0]
    except TestbedError as exc:
        run["check"] = {"error": str(exc)}
    run["seconds"] = time.monotonic() - t0
    run["hosts_by_server"] = {info["server_id"]: tb.servers[i].role for i, info in enumerate(tb.server_info)}
    run["cpu"] = cpu_windows(samplers, windows(run))
    return run


def _pids(tb: Testbed, names: list[str]) -> list[int]:
    out = []
    for n in names:
        try:
            out.append(tb.pid(n))
        except KeyError:   # not started yet
            pass
    return out


def run_scheme(s: Settings, scheme: str, tick: Any) -> dict[str, Any]:
    """The three runs of ``scheme`` on one testbed (3 servers, 2 spare hosts)."""
    from smb_train.workers import load_data, save_data
    out: dict[str, Any] = {}
    spares = sum(1 for name in s.runs if name != "undisturbed")
    with Testbed(s.servers + spares, s.workers, spares=spares, cap_mbit=s.cap_mbit,
                 lease_seconds=s.lease_seconds, log_level="INFO") as tb:
        data = tb.workdir / "digits.npz"
        save_data(str(data))
        train_size = len(load_data(str(data))["y_train"])
        spare = s.servers
        for name in s.runs:
            run = training_run(tb, s, scheme, name, None if name == "undisturbed" else spare, data, train_size)
            spare += name != "undisturbed"
            run["controller_log"] = move_log(tb.log_path("controller"), run.get("mover") or {})
            run["summary"] = summarize(run, s)
            out[name] = run
            tick(f"{scheme}, {name}: {line(run['summary'])}")
    for name in s.runs:
        if "undisturbed" in out:
            out[name]["summary"]["accuracy_undisturbed"] = out["undisturbed"]["summary"]["accuracy"]
        trim(out[name])
    return out


# -- analysis ---------------------------------------------------------------------------
def move_log(path: Path, mover: dict[str, Any]) -> dict[str, Any]:
    """The controller's log about the move's copies (:func:`.replica_failure.log_events`):
    copies brought in step, their bytes and seconds of copying, promotions."""
    from bench.cluster.replica_failure import log_events, replica_log
    start, end = mover.get("move_start"), mover.get("move_end")
    if not start:
        return {}
    try:
        lines = replica_log(path.read_text(errors="replace"))
    except OSError:
        return {}
    stop = (end or time.time()) + 0.5
    kept = [ln for ln in lines if (t := _log_time(ln)) is not None and t <= stop]
    return log_events(kept, start)


def _log_time(line_: str) -> float | None:
    from bench.cluster.replica_failure import _log_time as parse
    return parse(line_)


def step_ends(run: dict[str, Any]) -> list[list[float]]:
    """Every worker's step end times (time.time()), by rank."""
    return [[e[0] for e in w.get("step_log", [])] for w in sorted(run.get("workers", []), key=lambda w: w["rank"])]


def windows(run: dict[str, Any]) -> dict[str, list[float]]:
    """``time.time()`` spans of the run: ``whole`` (first start to last step), and with a
    move ``joining`` (the spare server starts), ``before`` (after the warm-up and the
    join, to the trigger), ``during`` the move and ``after`` it."""
    ends = [e for w in step_ends(run) for e in w]
    starts = [w["start_time"] for w in run.get("workers", []) if "start_time" in w]
    if not ends or not starts:
        return {}
    start, end = max(starts), max(ends)
    out = {"whole": [start + WARMUP, end]}
    m = run.get("mover") or {}
    if m.get("joined"):
        out["joining"] = [m["join_asked"], m["joined"]["time"]]
    if m.get("trigger"):
        out["before"] = [max(start + WARMUP, m["joined"]["time"]), m["trigger"]["time"]]
        if m.get("move_start"):
            move_end = m.get("move_end")
            out["during"] = [m["move_start"], move_end or end]
            if move_end and move_end < end:
                out["after"] = [move_end, end]
    return out


def steps_per_second(ends: list[list[float]], a: float, b: float) -> float | None:
    """Steps per second and worker between ``a`` and ``b``."""
    if b <= a or not ends:
        return None
    n = sum(bisect.bisect_right(w, b) - bisect.bisect_right(w, a) for w in ends)
    return n / len(ends) / (b - a)


def timeline(ends: list[list[float]], start: float, end: float, width: float) -> list[list[float]]:
    """[seconds since ``start`` at the bin's middle, steps/s per worker] per bin."""
    out, t = [], start
    while t < end:
        rate = steps_per_second(ends, t, min(end, t + width))
        if rate is not None:
            out.append([round(t - start + width / 2, 3), round(rate, 3)])
        t += width
    return out


def link_windows(run: dict[str, Any], spans: dict[str, list[float]], cap_mbit: float) -> dict[str, Any]:
    """Per span: every host's MB/s up (sent) and down (received), and the busiest link's
    share of the cap."""
    lk = run.get("links") or {}
    times, counters, roles = lk.get("times", []), lk.get("counters", []), lk.get("roles", [])
    out: dict[str, Any] = {}
    if len(times) < 2:
        return out
    for span, (a, b) in spans.items():
        i, j = bisect.bisect_left(times, a), bisect.bisect_right(times, b) - 1
        if j <= i:
            continue
        dt = times[j] - times[i]
        per = {role: {"up_MBps": (counters[j][p][0] - counters[i][p][0]) / dt / 1e6,
                      "down_MBps": (counters[j][p][1] - counters[i][p][1]) / dt / 1e6}
               for p, role in enumerate(roles)}
        busiest = max(per, key=lambda r: max(per[r].values()))
        out[span] = {"hosts": per, "busiest": busiest,
                     "busiest_share_of_cap": max(per[busiest].values()) / (cap_mbit / 8) if cap_mbit else None}
    return out


def link_timeline(run: dict[str, Any], start: float, end: float, width: float) -> dict[str, list[list[float]]]:
    """Per memory-server host: [seconds since ``start``, MB/s sent + received] per bin
    up to ``end``."""
    lk = run.get("links") or {}
    times, counters, roles = lk.get("times", []), lk.get("counters", []), lk.get("roles", [])
    out: dict[str, list[list[float]]] = {}
    if len(times) < 2:
        return out
    for p, role in enumerate(roles):
        if not role.startswith("srv"):
            continue
        series, t = [], start
        while t + width <= min(end + width, times[-1]):
            i, j = bisect.bisect_left(times, t), bisect.bisect_left(times, t + width)
            j = min(j, len(times) - 1)
            if j > i and times[j] > times[i]:
                moved = sum(counters[j][p]) - sum(counters[i][p])
                series.append([round(t - start + width / 2, 3), round(moved / (times[j] - times[i]) / 1e6, 3)])
            t += width
        if any(v for _, v in series):
            out[role] = series
    return out


def cpu_windows(samplers: dict[str, CpuSampler], spans: dict[str, list[float]]) -> dict[str, Any]:
    """Per span: CPU cores each group of processes used, and the machine's busy share."""
    out: dict[str, Any] = {}
    for span, (a, b) in spans.items():
        row: dict[str, Any] = {}
        for g, sampler in samplers.items():
            u = sampler.usage(a, b)
            if u is not None:
                row[g] = round(u["cores"], 3)
                row["machine_busy"] = round(u["machine_busy"], 3)
        out[span] = row
    return out


def _step_stats(run: dict[str, Any], a: float, b: float) -> dict[str, Any]:
    """Median step seconds and mean seconds waiting for the memory box per step, in [a,
    b], from the workers' step logs as recorded: sync steps [end, seconds, exchange wait,
    loss]; SEASGD steps [end, seconds, elastic update, step count published, loss]."""
    secs, waits, updates, counts, longest = [], [], [], [], None
    for w in run.get("workers", []):
        for e in w.get("step_log", []):
            if a <= e[0] <= b:
                secs.append(e[1])
                wait = e[2] if len(e) == 4 else e[2] + e[3] if len(e) == 5 else None
                if wait is not None:
                    waits.append(wait)
                if len(e) == 5:
                    updates.append(e[2])
                    counts.append(e[3])
                if longest is None or e[1] > longest[0]:
                    longest = (e[1], wait)
    return {"median_step_seconds": statistics.median(secs) if secs else None,
            "mean_exchange_wait_seconds": statistics.fmean(waits) if waits else None, "steps": len(secs),
            "mean_update_seconds": statistics.fmean(updates) if updates else None,
            "mean_count_seconds": statistics.fmean(counts) if counts else None,
            "longest_step_seconds": longest[0] if longest else None,
            "longest_step_exchange_wait": longest[1] if longest else None}


def summarize(run: dict[str, Any], s: Settings) -> dict[str, Any]:
    """The figures of the report for one run."""
    spans = windows(run)
    ends = step_ends(run)
    m, check = run.get("mover") or {}, run.get("check") or {}
    master = [w for w in run.get("workers", []) if w.get("rank") == 0]
    out: dict[str, Any] = {"ok": run["error"] is None and bool(spans), "error": run["error"],
                           "accuracy": master[0]["accuracy"] if master else None,
                           "steps_per_second": {k: steps_per_second(ends, *v) for k, v in spans.items()},
                           "steps": {k: _step_stats(run, *v) for k, v in spans.items()},
                           "links": link_windows(run, spans, s.cap_mbit)}
    if spans:
        start = spans["whole"][0] - WARMUP
        out["start"] = start
        out["timeline"] = timeline(ends, start, spans["whole"][1], s.bin_seconds)
        out["link_timeline"] = link_timeline(run, start, spans["whole"][1], s.bin_seconds)
        out["windows"] = {k: [round(a - start, 3), round(b - start, 3)] for k, (a, b) in spans.items()}
    if m.get("move_start"):
        out["move"] = {"seconds": (m["move_end"] - m["move_start"]) if m.get("move_end") else None,
                       "bytes_moved": m.get("bytes_moved"),
                       "source": dict(m["source"], host=run.get("hosts_by_server", {}).get(m["source"]["server"]))
                       if m.get("source") else None,
                       "joined": (m.get("joined") or {}).get("host"),
                       "job_bytes_before": _by_host(run, m.get("job_bytes_before") or {}),
                       "job_bytes_after": _by_host(run, _per_server(m.get("store_after") or {})),
                       "primary_bytes_before": _by_host(run, _per_server(m.get("heads_before") or {})),
                       "primary_bytes_after": _by_host(run, _per_server(m.get("heads_after") or {})),
                       "heads_before": {k: _by_host(run, v) for k, v in (m.get("heads_before") or {}).items()},
                       "heads_after": {k: _by_host(run, v) for k, v in (m.get("heads_after") or {}).items()},
                       # slots headed (primaries), per region and per server
                       "head_slots_before": {k: _by_host(run, v) for k, v in
                                             (m.get("head_slots_before") or {}).items()},
                       "head_slots_after": {k: _by_host(run, v) for k, v in
                                            (m.get("head_slots_after") or {}).items()},
                       "server_head_slots_before": _by_host(run, _per_server(m.get("head_slots_before") or {})),
                       "server_head_slots_after": _by_host(run, _per_server(m.get("head_slots_after") or {})),
                       "removed": m.get("removed"), "finished_before_training": bool(
                           m.get("move_end") and spans and m["move_end"] < spans["whole"][1]),
                       "controller_log": run.get("controller_log")}
    seen = {st for _, states in m.get("states", []) for st in states.values()}
    copies = check.get("copies") or {}
    identical = bool(copies) and all(c["identical"] for c in copies.values())
    weights = check.get("weights") or {}
    counters = check.get("counters") or {}
    if "differing_bytes_store_vs_workers" in weights:   # sync
        weights_ok = max(weights["differing_bytes_store_vs_workers"]) == 0 and \
            weights["differing_bytes_between_workers"] == 0
    else:   # SEASGD: an error below half the smallest pushed delta rules out a delta lost or applied twice
        smallest = min((w["smallest_delta"] for w in run.get("workers", []) if w.get("smallest_delta")),
                       default=None)
        weights_ok = weights.get("max_abs_error") is not None and smallest is not None and \
            weights["max_abs_error"] < smallest / 2 and bool(counters.get("consistent"))
    states_end = check.get("states") or {}
    out["check"] = {
        "states_seen": sorted(seen), "states_end": states_end,
        "copies_identical": identical,
        "copies_bytes_compared": sum(c["bytes_compared"] for c in copies.values()) if copies else None,
        "copies_differing_bytes": sum(c["differing_bytes"] for c in copies.values()) if copies else None,
        "weights": weights, "counters_consistent": counters.get("consistent"), "weights_ok": weights_ok,
        "mover_errors": len(m.get("errors", [])),
        "error": check.get("error")}
    out["bytes_lost"] = 0 if (out["ok"] and identical and weights_ok and states_end
                              and all(v == "ready" for v in states_end.values())
                              and "lost" not in seen) else None
    out["cpu"] = run.get("cpu")
    return out


def _per_server(store: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per in store.values():
        for server, n in per.items():
            out[server] = out.get(server, 0) + n
    return out


def _by_host(run: dict[str, Any], per_server: dict[str, int]) -> dict[str, int]:
    """Server ids -> host roles (``srv<i>``), from the servers' ready files."""
    names = run.get("hosts_by_server", {})
    return {names.get(k, k): v for k, v in sorted(per_server.items()) if v}


def trim(run: dict[str, Any]) -> None:
    """Make a run's record fit the results file: step logs rounded, raw link samples
    and the mover's sample lists dropped (the summary holds their figures)."""
    for w in run.get("workers", []):
        w["step_log"] = [[round(x, 4) for x in e[:-1]] for e in w.get("step_log", [])]
        w.pop("curve", None)
        w.pop("traffic", None)
    run.pop("links", None)
    m = run.get("mover") or {}
    for key in ("progress", "servers", "not_ready_seen"):
        m.pop(key, None)
    m["moved"] = [[round(t, 3), b] for t, b in m.get("moved", [])][::5]


def line(summary: dict[str, Any]) -> str:
    sps = summary["steps_per_second"]
    parts = [f"{k} {v:.2f}" for k, v in sps.items() if v is not None and k != "joining"]
    move = summary.get("move")
    if move and move.get("seconds") is not None:
        parts.append(f"moved {(move['bytes_moved'] or 0) / 1e6:.1f} MB in {move['seconds']:.2f} s")
    acc = summary.get("accuracy")
    parts.append(f"accuracy {acc:.3f}" if acc is not None else "no accuracy")
    parts.append(f"bytes lost {summary['bytes_lost']}" if summary["bytes_lost"] is not None else "CHECK FAILED")
    if summary["error"]:
        parts.append("FAILED: " + summary["error"].strip().splitlines()[-1])
    return "steps/s " + ", ".join(parts)


# -- report -----------------------------------------------------------------------------
def _f(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(results: dict[str, Any]) -> str:
    """The Markdown tables: the moves, then where the time goes."""
    rows = ["| scheme | move | time to move (s) | bytes moved (MB) | copies made, seconds copying "
            "| steps/s before | during | after "
            "| undisturbed | accuracy (undisturbed) | copies compared (MB, differing bytes) | weights check "
            "| regions at the end | bytes lost |",
            "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | ---: |"]
    for scheme in results.get("schemes", []):
        runs = results[scheme]
        base = (runs.get("undisturbed") or {}).get("summary") or {"steps_per_second": {}, "accuracy": None}
        for name in ("evacuate", "rebalance"):
            if name not in runs:
                continue
            sm = runs[name]["summary"]
            mv, sps, ck = sm.get("move") or {}, sm["steps_per_second"], sm["check"]
            what = (f"evacuate {(mv.get('source') or {}).get('host', '?')}" if name == "evacuate"
                    else f"rebalance onto {mv.get('joined', '?')}")
            ends = sorted(set((ck["states_end"] or {}).values()))
            cl = mv.get("controller_log") or {}
            weights = "FAILED" if not ck["weights_ok"] else "identical" if scheme == "sync" else "exact"
            lost = "CHECK FAILED" if sm["bytes_lost"] is None else str(sm["bytes_lost"])
            rows.append(
                f"| {scheme} | {what} | {_f(mv.get('seconds'))} | {_f((mv.get('bytes_moved') or 0) / 1e6, '.1f')} "
                f"| {cl.get('copies', '-')}, {_f(cl.get('copy_seconds'))} "
                f"| {_f(sps.get('before'))} | {_f(sps.get('during'))} | {_f(sps.get('after'))} "
                f"| {_f(base['steps_per_second'].get('whole'))} "
                f"| {_f(sm['accuracy'], '.3f')} ({_f(base['accuracy'], '.3f')}) "
                f"| {_f((ck['copies_bytes_compared'] or 0) / 1e6, '.1f')}, {_f(ck['copies_differing_bytes'], 'd')} "
                f"| {weights} | {', '.join(ends) or '-'} | {lost} |")
    where = ["| scheme | move | window | steps/s | median step (s) "
             "| memory-box wait per step (s; SEASGD: update + step count) "
             "| longest step (s; its memory-box wait) "
             "| CPU cores: workers / servers / controller | machine busy | busiest link (MB/s, share of cap) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for scheme in results.get("schemes", []):
        for name in ("evacuate", "rebalance"):
            sm = results[scheme].get(name, {}).get("summary")
            if not sm:
                continue
            for span in ("before", "during", "after"):
                st, cpu, lk = sm["steps"].get(span), (sm.get("cpu") or {}).get(span) or {}, sm["links"].get(span)
                if st is None:
                    continue
                busiest = "-" if not lk else (f"{lk['busiest']} {max(lk['hosts'][lk['busiest']].values()):.1f} "
                                              f"({_f(lk['busiest_share_of_cap'], '.0%')})")
                longest = _f(st.get("longest_step_seconds"), ".3f")
                if st.get("longest_step_exchange_wait") is not None:
                    longest += f"; {st['longest_step_exchange_wait']:.3f}"
                wait = _f(st['mean_exchange_wait_seconds'], '.3f')
                if st.get("mean_update_seconds") is not None:
                    wait += f" ({st['mean_update_seconds']:.3f} + {st['mean_count_seconds']:.3f})"
                where.append(f"| {scheme} | {name} | {span} | {_f(sm['steps_per_second'].get(span))} "
                             f"| {_f(st['median_step_seconds'], '.3f')} "
                             f"| {wait} | {longest} "
                             f"| {_f(cpu.get('workers'))} / {_f(cpu.get('servers'))} / {_f(cpu.get('controller'))} "
                             f"| {_f(cpu.get('machine_busy'), '.0%')} | {busiest} |")
    places = ["| scheme | move | job's bytes per server before (MB) | after | primaries' bytes before | after |",
              "| --- | --- | --- | --- | --- | --- |"]
    for scheme in results.get("schemes", []):
        for name in ("evacuate", "rebalance"):
            mv = (results[scheme].get(name, {}).get("summary") or {}).get("move")
            if not mv:
                continue
            cells = [", ".join(f"{h} {n / 1e6:.1f}" for h, n in sorted((mv.get(k) or {}).items())) or "-"
                     for k in ("job_bytes_before", "job_bytes_after", "primary_bytes_before", "primary_bytes_after")]
            places.append(f"| {scheme} | {name} | " + " | ".join(cells) + " |")
    heads = ["| scheme | move | region | its primaries before (MB) | after | slots it heads before | after |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for scheme in results.get("schemes", []):
        for name in ("evacuate", "rebalance"):
            mv = (results[scheme].get(name, {}).get("summary") or {}).get("move") or {}
            for region in sorted(mv.get("heads_before") or {}):
                cells = [", ".join(f"{h} {_size(n)}" for h, n in sorted((mv.get(k) or {}).get(region, {}).items()))
                         or "-" for k in ("heads_before", "heads_after")]
                cells += [_slots((mv.get(k) or {}).get(region)) for k in ("head_slots_before", "head_slots_after")]
                heads.append(f"| {scheme} | {name} | {region} | " + " | ".join(cells) + " |")
            if mv.get("server_head_slots_before") is not None:
                cells = [_slots(mv.get(k)) for k in ("server_head_slots_before", "server_head_slots_after")]
                heads.append(f"| {scheme} | {name} | every region | | | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(where) + "\n\n" + "\n".join(places) + "\n\n" + \
        "\n".join(heads) + "\n"


def _slots(per_host: dict[str, int] | None) -> str:
    """Slots headed per host (``srv1 2, srv2 1``), or ``-`` (a run recorded before they were)."""
    return ", ".join(f"{h} {n}" for h, n in sorted(per_host.items())) if per_host else "-"


def _size(n: int) -> str:
    """Bytes as MB with two decimals, or in bytes where that shows 0.00."""
    return f"{n / 1e6:.2f}" if n >= 5000 else f"{n} B"


def plot(results: dict[str, Any], name: str, path: str) -> None:
    """Steps/s over time of the ``name`` runs (and the undisturbed ones), the move's
    window shaded, and the memory servers' links below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    schemes = [x for x in results.get("schemes", []) if name in results[x]]
    fig, axes = plt.subplots(2, len(schemes), figsize=(5.2 * len(schemes), 6.0), squeeze=False, sharex="col")
    for col, scheme in enumerate(schemes):
        sm, base = results[scheme][name]["summary"], (results[scheme].get("undisturbed") or {}).get("summary", {})
        ax, lx = axes[0][col], axes[1][col]
        if base.get("timeline"):
            bx, by = zip(*base["timeline"], strict=True)
            ax.plot(bx, by, color="0.6", ls="--", lw=1, label="undisturbed run")
        if sm.get("timeline"):
            x, y = zip(*sm["timeline"], strict=True)
            ax.plot(x, y, color="C0", lw=1.5, label=f"{name} run")
        w = sm.get("windows", {})
        for a_ in (ax, lx):
            if "joining" in w:
                a_.axvspan(*w["joining"], color="C2", alpha=0.15, lw=0)
            if "during" in w:
                a_.axvspan(*w["during"], color="C3", alpha=0.2, lw=0)
        mv = sm.get("move") or {}
        label = (f"evacuating {(mv.get('source') or {}).get('host', '?')}" if name == "evacuate"
                 else f"rebalancing onto {mv.get('joined', '?')}")
        ax.axvspan(0, 0, color="C3", alpha=0.2, label=f"{label} ({_f(mv.get('seconds'))} s, "
                                                      f"{(mv.get('bytes_moved') or 0) / 1e6:.1f} MB)")
        ax.axvspan(0, 0, color="C2", alpha=0.15, label="spare server starting")
        trainer = "SyncDataParallel" if scheme == "sync" else "SEASGD"
        ax.set_title(f"{trainer}, {results['settings']['workers']} workers", fontsize=9)
        ax.set_ylabel("steps/s per worker")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
        for i, (role, series) in enumerate(sorted((sm.get("link_timeline") or {}).items())):
            x, y = zip(*series, strict=True)
            lx.plot(x, y, lw=1, color=f"C{i}", label=role)
        lx.set_ylabel("server link MB/s (sent + received)")
        lx.set_xlabel("seconds since the start of training")
        lx.grid(True, alpha=0.3)
        lx.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: dict[str, Any], png_dir: str | None) -> list[str]:
    print(table(results))
    pngs = []
    if png_dir:
        for name in ("evacuate", "rebalance"):
            path = os.path.join(png_dir, f"elastic-{name}.png")
            plot(results, name, path)
            pngs.append(path)
    return pngs


# -- command line -----------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python -m bench.elastic", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 workers, 2 servers, 10 epochs of a 256-wide model")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated subset of sync,seasgd")
    ap.add_argument("--epochs", type=int, help=f"epochs of every run (default {d.epochs})")
    ap.add_argument("--hidden", type=int, help=f"width of the model's hidden layers (default {d.hidden})")
    ap.add_argument("--replicas", type=int, help=f"copies of the parameter store (default {d.replicas})")
    ap.add_argument("--cap-mbit", type=float, help=f"link cap, Mbit/s each direction (default {d.cap_mbit:g})")
    ap.add_argument("--fraction", type=float, help=f"of the training, when the move starts (default {d.fraction})")
    ap.add_argument("--rate", type=float, help="rebalance limit in bytes/s (default 0: none)")
    ap.add_argument("--out", help="JSON results (default bench/results/elastic.json; --quick: elastic-quick.json)")
    ap.add_argument("--png-dir", help="where the plots go (default docs/img; --quick: none unless given)")
    ap.add_argument("--log-level", default="WARNING", help="of this process and the daemons")
    ap.add_argument("--from-json", metavar="PATH", help="only print the tables and draw the plots from a results file")
    return ap.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    s = QUICK if args.quick else Settings()
    changes: dict[str, Any] = {"log_level": args.log_level.upper()}
    for key in ("epochs", "hidden", "replicas", "cap_mbit", "fraction", "rate"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    schemes = tuple(x.strip() for x in args.schemes.split(",") if x.strip())
    if not schemes or set(schemes) - set(SCHEMES):
        raise SystemExit(f"--schemes: expected a subset of {','.join(SCHEMES)}, got {args.schemes}")
    changes["schemes"] = schemes
    return replace(s, **changes)


def run_all(s: Settings, tick: Any) -> dict[str, Any]:
    results: dict[str, Any] = {"settings": asdict(s), "schemes": list(s.schemes)}
    for scheme in s.schemes:
        results[scheme] = run_scheme(s, scheme, tick)
    return results


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)   # unwinds through the testbed's teardown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.from_json:
        with open(args.from_json) as f:
            write_report(json.load(f), args.png_dir or str(ROOT / "docs/img"))
        return 0
    reason = netns.unavailable_reason()
    if reason:
        print(f"bench.elastic: cannot build the testbed: {reason}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    cleanup()
    s = settings_from(args)
    out = args.out or str(ROOT / "bench/results" / ("elastic-quick.json" if args.quick else "elastic.json"))
    png_dir = args.png_dir or (None if args.quick else str(ROOT / "docs/img"))
    t0 = time.monotonic()

    def tick(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {message}", flush=True)
    results = run_all(s, tick)
    results.update(host=platform.node(), kernel=platform.release(), cpus=os.cpu_count(),
                   python=platform.python_version(), seconds=time.monotonic() - t0,
                   load_average_at_end=os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    pngs = write_report(results, png_dir)
    print(f"results: {out}; plots: {', '.join(pngs) or 'none'}; {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
