"""The replication experiment: SEASGD training survives a memory server killed mid-run.

On one testbed (``s.repl_servers`` memory servers and ``s.repl_workers`` worker hosts,
each in its own namespace), the digits trainer's SEASGD workers (the code ``smb train``
runs, :mod:`smb_train.workers`) train twice with the same seeds, their parameter
store created with ``replicas=s.repl_replicas``:

1. ``undisturbed``: nothing happens;
2. ``kill``: once the workers' shared iteration counters reach ``s.repl_kill_fraction``
   of the target, the memory server holding the primary copy of the counters (and of a
   slot of the global weights) gets SIGKILL (``kill -9``). Training must go on without a
   restart: the workers' operations wait for the controller to promote the backups, the
   controller repairs the missing copies onto the spare server, the regions go
   ``ready`` -> ``degraded`` -> ``ready``.

A monitor on the controller's host (:func:`.replica_worker.monitor`) records the
regions' and servers' states, the counters and the copies' roles; after the workers
finished, :func:`.replica_worker.check` compares every copy of every slot byte for byte,
the global weights against the initial weights plus every delta pushed, and the
counters against the workers' own step counts. :func:`summarize` turns both runs into
the measures of the report (see :func:`.report.replication_table`).
"""
from __future__ import annotations

import datetime
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from . import signal_files
from .testbed import Testbed, TestbedError, kill_process

log = logging.getLogger(__name__)

METRICS_PORT = 9464        # the daemons' /metrics, on their own namespace address
LOG_WORDS = ("promot", "repair", "degraded", "syncing", "replica")   # controller log lines kept
RUNS = ("undisturbed", "kill")


def _trainer_argv(s: Any, job: str, data: Path, result_dir: Path) -> list[str]:
    return ["--scheme", "seasgd", "--data", str(data), "--job", job, "--epochs", str(s.repl_epochs),
            "--batch", str(s.repl_batch), "--hidden", str(s.repl_hidden), "--seed", str(s.repl_seed),
            "--placement", "striped", "--interval", str(s.repl_interval), "--stop-rule", "average",
            "--replicas", str(s.repl_replicas), "--eval-every", str(s.repl_eval_every),
            "--record-steps", "--keep-store", "--quiet", "--result-dir", str(result_dir)]


def training_run(tb: Testbed, s: Any, name: str, kill: bool, data: Path, train_size: int) -> dict[str, Any]:
    """One training run on ``tb`` (``kill``: with the memory server killed mid-run);
    never raises for a failure of the run itself: it is reported under ``error``."""
    world = s.repl_workers
    job = f"repl-{name}"
    prefix = f"{job}/seasgd"
    sig = tb.workdir / job
    sig.mkdir(exist_ok=True)
    results = sig / "results"
    results.mkdir(exist_ok=True)
    per_worker = min(len(range(r, train_size, world)) for r in range(world)) // s.repl_batch
    target_total = per_worker * s.repl_epochs * world
    common = {"controller": tb.controller_address, "log_level": s.log_level}
    mon_spec = {**common, "mode": "monitor", "prefix": prefix, "world": world, "target_total": target_total,
                "kill": kill, "kill_fraction": s.repl_kill_fraction, "signal_dir": str(sig),
                "metrics": tb.metrics_urls(), "timeout": s.repl_timeout, "poll": 0.1}
    run: dict[str, Any] = {"job": job, "target_total": target_total, "error": None}
    mon, mon_out = tb.start_worker(tb.controller, f"{job}-monitor", mon_spec)
    argv = _trainer_argv(s, job, data, results)
    workers = [(f"{job}-w{r}", *tb.start_worker(tb.workers[r], f"{job}-w{r}",
                                                  {**common, "mode": "train", "rank": r, "world": world,
                                                   "argv": argv}))
               for r in range(world)]
    deadline = time.monotonic() + s.repl_timeout
    killed: dict[str, Any] | None = None

    def kill_when_asked() -> None:
        nonlocal killed
        if kill and killed is None and (sig / "kill.json").exists():
            victim = json.loads((sig / "placement.json").read_text())["victim"]
            host = tb.server_host(victim)
            when = tb.kill_server(tb.servers.index(host))
            killed = {"time": when, "server": victim, "role": host.role, "address": host.address}
            signal_files.write(sig / "killed.json", killed)
            log.info("killed %s (%s) at %.3f", host.role, victim, when)
    finished, run["error"] = tb.watch_workers(workers, s.repl_timeout, kill_when_asked)
    run["killed"] = killed
    run["workers"] = finished
    if run["error"]:
        signal_files.write(sig / "stop.json", {"time": time.time()})
    try:
        run["monitor"] = tb.wait_worker(f"{job}-monitor", mon, mon_out,
                                        timeout=max(5.0, deadline - time.monotonic()) + 40.0)
    except TestbedError as exc:
        run["monitor"] = None
        run["monitor_error"] = str(exc)
    finally:
        kill_process(mon)
    spec = {**common, "prefix": prefix, "world": world, "seed": s.repl_seed, "hidden": s.repl_hidden,
            "result_dir": str(results), "local_steps": [w["local_steps"] for w in
                                                         sorted(run["workers"], key=lambda w: w["rank"])]}
    if run["error"] is None:
        try:
            run["check"] = tb.run_workers([{**spec, "mode": "check"}], hosts=[tb.controller],
                                          name=f"{job}-check", timeout=120.0)[0]
        except TestbedError as exc:
            run["check_error"] = str(exc)
    if "check" not in run:   # the store is still there
        try:
            run["cleanup"] = tb.run_workers([{**spec, "mode": "cleanup_store"}], hosts=[tb.controller],
                                            name=f"{job}-cleanup", timeout=60.0)[0]
        except TestbedError as exc:
            run["cleanup"] = {"error": str(exc)}
    return run


def replica_log(text: str) -> list[str]:
    """The controller's log lines about promotions, repairs and replica sets."""
    return [line for line in text.splitlines() if any(w in line.lower() for w in LOG_WORDS)]


def run(s: Any, tick: Any) -> dict[str, Any]:
    """Both runs on one testbed (undisturbed first: the kill leaves one server fewer)."""
    from smb_train.workers import load_data, save_data
    out: dict[str, Any] = {"workers": s.repl_workers, "servers": s.repl_servers, "replicas": s.repl_replicas,
                           "epochs": s.repl_epochs, "batch": s.repl_batch, "hidden": s.repl_hidden,
                           "seed": s.repl_seed, "interval": s.repl_interval, "kill_fraction": s.repl_kill_fraction,
                           "lease_seconds": s.lease_seconds, "cap_mbit": s.cap_mbit}
    with Testbed(s.repl_servers, s.repl_workers, cap_mbit=s.cap_mbit, lease_seconds=s.lease_seconds,
                 log_level="INFO", metrics_port=METRICS_PORT) as tb:
        data = tb.workdir / "digits.npz"
        save_data(str(data))
        train_size = len(load_data(str(data))["y_train"])
        for name in RUNS:
            t0 = time.monotonic()
            out[name] = training_run(tb, s, name, name == "kill", data, train_size)
            out[name]["seconds"] = time.monotonic() - t0
            acc = accuracy(out[name])
            tick(f"replication, {name}: " + (f"accuracy {acc:.3f}" if acc is not None else "no accuracy")
                 + (f"; FAILED: {out[name]['error'].strip().splitlines()[-1]}" if out[name]["error"] else ""))
        try:
            out["controller_log"] = replica_log(tb.log_path("controller").read_text(errors="replace"))
        except OSError:
            out["controller_log"] = []
    out["summary"] = summarize(out)
    for name in RUNS:
        if name in out:
            trim(out[name], keep_steps=name == "kill")
    return out


def trim(run: dict[str, Any], keep_steps: bool) -> None:
    """Make a run's record fit a results file: step logs only where ``keep_steps`` (the
    plot's), rounded; the monitor's counters once a second; no metrics series."""
    for w in run.get("workers", []):
        steps = w.pop("step_log", None) or []
        if keep_steps:
            w["step_log"] = [[round(e[0], 3), round(e[1], 4), round(e[-1], 4)] for e in steps]
        durations = sorted(e[1] for e in steps)
        if durations:
            w["step_seconds"] = {"median": durations[len(durations) // 2], "max": durations[-1]}
        w["curve"] = [[round(x, 4) for x in c] for c in w.get("curve", [])]
    mon = run.get("monitor") or {}
    mon.pop("metrics_series", None)
    progress, kept = mon.get("progress", []), []
    for t, total in progress:
        if not kept or t - kept[-1][0] >= 1.0 or (t, total) == tuple(progress[-1]):
            kept.append([round(t, 3), total])
    if progress:
        mon["progress"] = kept


# -- analysis ---------------------------------------------------------------------------
def accuracy(run: dict[str, Any]) -> float | None:
    """Test accuracy of the global weights at the end (rank 0's evaluation)."""
    master = [w for w in run.get("workers", []) if w.get("rank") == 0]
    return master[0]["accuracy"] if master else None


def _first(entries: list[list[Any]], after: float, pred: Any) -> float | None:
    return next((t for t, v in entries if t >= after and pred(v)), None)


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
SYNC_START = re.compile(r"slot (\d+): bringing copy (\d+) .* in step from the primary")
SYNC_DONE = re.compile(r"slot (\d+): copy (\d+) on server \S+ in step \((\d+) bytes copied in "
                       r"([\d.]+) s, ([\d.]+) MB/s\)")
PROMOTED = re.compile(r"is the primary now")
DROPPED = re.compile(r"cannot reach copy \d+|dropped from the replica set")


def _log_time(line: str) -> float | None:
    """The time.time() of a daemon's text log line (``asctime``: local time, ms)."""
    m = LOG_TIME.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(lines: list[str], after: float) -> dict[str, Any]:
    """Promotions and repairs the controller logged after ``after``: when the first
    backup was promoted, when the copies' syncs began and ended, bytes copied."""
    promoted, dropped, starts, done = [], [], [], []
    for line in lines:
        t = _log_time(line)
        if t is None or t < after - 1.0:   # log times have ms; the kill's clock is the same
            continue
        if PROMOTED.search(line):
            promoted.append(t)
        elif DROPPED.search(line):
            dropped.append(t)
        elif SYNC_START.search(line):
            starts.append(t)
        elif m := SYNC_DONE.search(line):
            done.append((t, int(m.group(3)), float(m.group(4))))
    out: dict[str, Any] = {"promotions": len(promoted), "first_promotion": min(promoted, default=None),
                           "last_promotion": max(promoted, default=None), "copies": len(done),
                           "drops": len(dropped), "first_change": min(promoted + dropped, default=None)}
    if starts and done:
        out.update(first_sync_start=min(starts), last_sync_done=max(t for t, _, _ in done),
                   bytes=sum(b for _, b, _ in done), copy_seconds=sum(sec for _, _, sec in done))
        out["seconds"] = out["last_sync_done"] - out["first_sync_start"]
    return out


def _metric_delta(mon: dict[str, Any], name: str) -> float:
    """Growth of the controller's metric ``name`` from the kill to the end."""
    def value(m: dict[str, Any] | None) -> float:
        ctl = (m or {}).get("ctl") or {}
        return sum(v for k, v in ctl.items() if isinstance(v, (int, float)) and k.split("{")[0] == name)
    return value(mon.get("metrics_after")) - value(mon.get("metrics_at_kill"))


def _sync_bytes(metrics: dict[str, Any] | None) -> float:
    total = 0.0
    for values in (metrics or {}).values():
        if isinstance(values, dict):
            total += sum(v for k, v in values.items() if k.startswith("smb_server_replica_sync_bytes_total"))
    return total


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """The measures of the report from both runs (None where a run did not get there)."""
    out: dict[str, Any] = {name: {"accuracy": accuracy(r[name]) if name in r else None} for name in RUNS}
    for name in RUNS:
        if name in r:
            out[name]["ok"] = r[name]["error"] is None
            out[name]["seconds"] = max((w["time"] for w in r[name]["workers"]), default=None)
    k = r.get("kill") or {}
    killed, mon = k.get("killed"), k.get("monitor") or {}
    if not killed:
        return out
    t = killed["time"]
    states = mon.get("states", [])
    events = log_events(r.get("controller_log", []), t)
    # degraded from the first replica-set change the controller made (or the first look
    # that saw a region not ready, if earlier) to the first look that saw every region
    # ready with no copy left on the killed server: a quick repair can fall between two
    # looks at the states
    seen = _first(states, t, lambda v: any(st != "ready" for st in v.values()))
    degraded = min((x for x in (seen, events.get("first_change")) if x is not None), default=None)
    ready = mon.get("repaired_at")
    down = _first(mon.get("servers", []), t, lambda v: v.get(killed["server"]) == "down")
    probe = mon.get("probe") or {}
    syncing = _first(mon.get("roles", []), t,
                     lambda v: any(role == "syncing" for copies in v.values() for _, _, role in copies))
    repair: dict[str, Any] = {"log": events, "metrics_bytes": _metric_delta(
        mon, "smb_controller_repair_bytes_total"), "server_sync_bytes": _sync_bytes(mon.get("metrics_after"))
        - _sync_bytes(mon.get("metrics_at_kill"))}
    if events.get("bytes"):
        repair.update(bytes=events["bytes"], seconds=events["seconds"], copy_seconds=events["copy_seconds"],
                      copies=events["copies"],
                      source="controller log: first sync started to last copy in step")
    else:   # from the metrics and the roles the monitor saw
        start = syncing or degraded
        repair.update(bytes=repair["metrics_bytes"] or repair["server_sync_bytes"] or None,
                      seconds=(ready - start) if ready and start else None,
                      source="metrics; from the first copy seen syncing (or degraded) to ready")
    busy = repair.get("copy_seconds") or repair.get("seconds")   # while copies were being made
    if repair.get("bytes") and busy:
        repair["MBps"] = repair["bytes"] / busy / 1e6
    stalls = []
    for w in sorted(k.get("workers", []), key=lambda w: w["rank"]):
        log_ = w.get("step_log") or []
        end = ready or (t + 60)
        during = [(e[0], e[1]) for e in log_ if e[0] >= t and e[0] - e[1] <= end]
        longest = max(during, key=lambda x: x[1], default=None)
        normal = sorted(e[1] for e in log_ if e[0] < t)
        stalls.append({"rank": w["rank"], "longest_step": longest[1] if longest else None,
                       "resumed_after": longest[0] - t if longest else None,
                       "median_step": normal[len(normal) // 2] if normal else None})
    check = k.get("check") or {}
    copies = check.get("copies") or {}
    weights, counters = check.get("weights") or {}, check.get("counters") or {}
    identical = bool(copies) and all(c["identical"] for c in copies.values())
    out["failure"] = {
        "killed_server": killed["server"], "killed_host": killed["role"], "victim": mon.get("victim"),
        "marked_down_after": down - t if down else None,
        "promoted_after": events["first_promotion"] - t if events.get("first_promotion") else None,
        "promotions": events.get("promotions"),
        "degraded_after": degraded - t if degraded else None,
        "first_op_at_new_primary_after": (probe["done_at"] - t) if probe.get("done_at") and not probe.get("error")
        else None,
        "probe_error": probe.get("error"),
        "degraded_seconds": ready - degraded if ready and degraded else None,
        "ready_after": ready - t if ready else None,
        "repair": repair, "stalls": stalls,
        "copies_identical": identical if copies else None,
        "copies_bytes_compared": sum(c["bytes_compared"] for c in copies.values()) if copies else None,
        "copies_differing_bytes": sum(c["differing_bytes"] for c in copies.values()) if copies else None,
        "weights_max_abs_error": weights.get("max_abs_error"),
        "weights_max_abs_pushed": weights.get("max_abs_pushed"),
        "counters_consistent": counters.get("consistent"),
        "counters": counters,
        "states_after": {n: c["state"] for n, c in copies.items()} if copies else None,
    }
    # a delta lost or applied twice leaves an error at least as large as that delta's
    # largest element, so an error below half the smallest such element rules both out
    smallest = min((w["smallest_delta"] for w in k.get("workers", []) if w.get("smallest_delta")), default=None)
    out["failure"]["smallest_delta"] = smallest
    ok_weights = weights.get("max_abs_error") is not None and smallest is not None \
        and weights["max_abs_error"] < smallest / 2
    out["failure"]["bytes_lost"] = (0 if identical and ok_weights and counters.get("consistent") else None)
    return out
