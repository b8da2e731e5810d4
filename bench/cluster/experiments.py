"""The cluster experiments: bandwidth scaling, sharding, aggregation, failure,
replication (:mod:`.replica_failure`), training against DDP (:mod:`.training`) and
weights to many readers against a gloo broadcast (:mod:`.weights`).

Each experiment runs workers (:mod:`.worker`) on a :class:`~.testbed.Testbed` and
returns a JSON-able dict; :mod:`.report` turns the dicts into tables and plots.
Bandwidths are MB/s (1e6 bytes per second), times seconds, link caps Mbit/s.
"""
from __future__ import annotations

import logging
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from smb_server.commands.local_cluster import wait_for_json

from . import links, replica_failure, signal_files, training, weights
from .cpuload import CpuSampler
from .testbed import Testbed, TestbedError, live_pids

log = logging.getLogger(__name__)

MiB = 1 << 20
MASTER_PORT = 29500        # torch.distributed rendezvous on the first worker's host
FILE_POLL = 0.05           # seconds

Tick = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """What the experiments run; :data:`QUICK` is the short version the tests use."""

    cap_mbit: float = 500.0                       # link rate, each direction
    clients: int = 8                              # experiment 1
    server_counts: tuple[int, ...] = (1, 2, 4)
    op_bytes: int = 4 * MiB                       # one write/read of a client
    seconds: float = 5.0                          # per bandwidth point and direction
    shard_configs: tuple[tuple[int, int], ...] = ((2, 1), (4, 2), (8, 4))   # experiment 2: workers, servers
    shard_steps: int = 5
    shard_warmup: int = 1
    shard_stripe_unit: int = 64 << 10             # bytes; even shares of a 10 MB model
    model_inputs: int = 4096                      # the concentrated model's first layer
    model_hidden: int = 512
    sync_sizes: tuple[int, ...] = (25_000_000, 100_000_000)   # experiment 3, bytes
    sync_workers: int = 4
    # experiment 3 with memory servers on hosts of their own: (workers, servers)
    sync_dedicated: tuple[tuple[int, int], ...] = ((4, 4), (8, 4))
    # experiment 3, some memory servers on workers' hosts and some on hosts of their own:
    # (workers, servers, servers co-located with the first workers)
    sync_mixed: tuple[tuple[int, int, int], ...] = ((4, 4, 2),)
    syncs: int = 3
    sync_warmup: int = 1
    lease_seconds: float = 5.0                    # failure: controller lease (the default)
    io_timeout: float | None = None               # failure: the client's io_timeout (None: default)
    # replication: SEASGD (digits) with its store replicated; a memory server killed mid-run
    repl_workers: int = 4
    repl_servers: int = 3
    repl_replicas: int = 2
    repl_epochs: int = 15                         # 11 steps per worker and epoch with 4 workers
    repl_batch: int = 32
    repl_hidden: int = 1024                       # 1.1 M parameters, 4.5 MB: the links carry the updates
    repl_seed: int = 0
    repl_interval: int = 4                        # SEASGD update interval (steps)
    repl_eval_every: int = 4                      # rank 0 evaluates the global weights every so many steps
    repl_kill_fraction: float = 0.35              # of the target iterations, when the server is killed
    repl_timeout: float = 240.0                   # seconds a training run may take
    # training: SyncDataParallel against DDP, memory servers on hosts of their own (:mod:`.training`)
    train_workers: int = 4
    train_servers: int = 4
    train_layers: tuple[int, ...] = (1024, 2048, 1024, 10)   # 4.2 M parameters, 16.8 MB of gradients
    train_batch: int = 16
    train_steps: int = 8
    train_warmup: int = 2
    train_timeout: float = 240.0                  # seconds the workers may take
    # weights: a trainer publishing to readers against a gloo broadcast (:mod:`.weights`)
    weights_mb: int = 256                         # MiB of float32
    weights_readers: int = 8
    weights_servers: int = 4
    weights_rounds: int = 3                       # counted rounds (the medians), after the warm-up
    weights_warmup: int = 1
    weights_timeout: float = 1800.0               # seconds the workers may take
    log_level: str = "WARNING"
    only: tuple[str, ...] = ("bandwidth", "sharding", "allreduce", "mixed", "failure", "replication", "training",
                             "weights")


QUICK = Settings(cap_mbit=200.0, clients=2, server_counts=(1, 2), op_bytes=MiB, seconds=1.0,
                 shard_configs=((2, 2),), shard_steps=2, model_inputs=512, model_hidden=64,
                 sync_sizes=(2_000_000,), sync_workers=2, syncs=2, sync_dedicated=((2, 2),),
                 sync_mixed=((3, 3, 1),),
                 repl_workers=2, repl_epochs=6, repl_hidden=512, repl_timeout=150.0,
                 train_workers=2, train_servers=2, train_layers=(256, 256, 10), train_steps=3, train_warmup=1,
                 weights_mb=8, weights_readers=2, weights_servers=2, weights_rounds=2, weights_timeout=300.0)


# -- experiment 1: bandwidth scaling --------------------------------------------------
def _cumulative(run: dict[str, Any], t: float) -> float:
    """Bytes one client had moved at time ``t``, interpolated between its operations."""
    points = [run["start"], *run["done"]]
    op = run["op_bytes"]
    if t <= points[0]:
        return 0.0
    for i in range(1, len(points)):
        if t <= points[i]:
            return op * (i - 1 + (t - points[i - 1]) / (points[i] - points[i - 1]))
    return float(op * len(run["done"]))


def window_rate(runs: Sequence[dict[str, Any]]) -> tuple[float, float, float]:
    """Aggregate MB/s of clients over the window in which all of them were running
    (from the last start to the first finish); returns (MB/s, t0, t1)."""
    t0 = max(r["start"] for r in runs)
    t1 = min(r["done"][-1] for r in runs)
    if t1 - t0 < 0.1:   # no common window: fall back to each client's own rate
        rate = sum(len(r["done"]) * r["op_bytes"] / (r["done"][-1] - r["start"]) for r in runs)
        return rate / 1e6, min(r["start"] for r in runs), max(r["done"][-1] for r in runs)
    moved = sum(_cumulative(r, t1) - _cumulative(r, t0) for r in runs)
    return moved / (t1 - t0) / 1e6, t0, t1


def bandwidth(tb: Testbed, s: Settings, tick: Tick, cpu: CpuSampler | None = None) -> dict[str, Any]:
    """Aggregate write and read bandwidth of ``s.clients`` clients on a region striped
    (1 MiB unit) over 1, 2, 4 memory servers; each client moves its own slice of
    ``s.op_bytes`` per operation, one operation at a time, for ``s.seconds``."""
    points = []
    hosts = tb.workers[:s.clients]
    for k in s.server_counts:
        specs = [{"mode": "bandwidth", "rank": r, "world": s.clients, "op_bytes": s.op_bytes,
                  "servers": k, "seconds": s.seconds, "region": f"bw/k{k}", "stripe_unit": MiB,
                  "log_level": s.log_level} for r in range(s.clients)]
        runs = tb.run_workers(specs, hosts=hosts, name=f"bw-k{k}-")
        point: dict[str, Any] = {"servers": k, "region_servers": len(runs[0]["servers"]),
                                 "verified": all(r["verified"] for r in runs)}
        for kind in ("write", "read"):   # every operation of every client, warm-up excluded
            point[f"{kind}_bytes"] = sum(len(r[kind]["done"]) * r[kind]["op_bytes"] for r in runs)
        for kind in ("write", "read"):
            rate, t0, t1 = window_rate([r[kind] for r in runs])
            point[f"{kind}_MBps"] = rate
            point[f"{kind}_window_seconds"] = t1 - t0
            point[f"{kind}_cpu"] = cpu.usage(t0, t1) if cpu else None
        points.append(point)
        tick(f"bandwidth, {k} server{'s' if k > 1 else ''}: write {point['write_MBps']:.1f}, "
             f"read {point['read_MBps']:.1f} MB/s")
    cap = s.cap_mbit / 8 if s.cap_mbit else 0.0
    base = points[0]
    for p in points:
        for kind in ("write", "read"):
            linear = base[f"{kind}_MBps"] * p["servers"] / base["servers"]
            p[f"{kind}_scaling"] = p[f"{kind}_MBps"] / linear if linear else None
            p[f"{kind}_of_links"] = p[f"{kind}_MBps"] / (cap * p["servers"]) if cap else None
    return {"clients": s.clients, "op_bytes": s.op_bytes, "seconds": s.seconds, "stripe_unit": MiB,
            "link_MBps": cap, "points": points}


def _common(windows: Sequence[Sequence[float]]) -> list[float]:
    """The workers' common measured window, ``[start, end]``, given each worker's."""
    return [max(w[0] for w in windows), min(w[1] for w in windows)]


def _usage(cpu: CpuSampler | None, windows: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """CPU use over the workers' common measured window, given each worker's
    ``[start, end]`` (see :meth:`CpuSampler.usage`)."""
    return cpu.usage(*_common(windows)) if cpu is not None else None


# -- experiment 2: sharding ---------------------------------------------------------
def concentrated_model(inputs: int, hidden: int) -> Any:
    """An MLP ``inputs``-``hidden``-``hidden``-``hidden``-10; with 4096 inputs and 512 hidden
    units its first layer holds 80% of the parameters."""
    import torch
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


def _max_per_step(runs: Sequence[dict[str, Any]], placement: str, key: str) -> list[float]:
    """Per step, the slowest worker's ``key`` time (seconds)."""
    steps = len(runs[0][placement]["times"])
    return [max(r[placement]["times"][i][key] for r in runs) for i in range(steps)]


def sharding(tb: Testbed, s: Settings, tick: Tick, cpu: CpuSampler | None = None) -> dict[str, Any]:
    """Per step every worker accumulates its gradients into a region and, after a
    barrier, reads the parameters; striped vs layered placement of the model's
    tensors, for each (workers, memory servers) of ``s.shard_configs``."""
    from smb_client.torch.layout import FlatLayout
    model = concentrated_model(s.model_inputs, s.model_hidden)
    layout = FlatLayout.of_module(model)
    segments = layout.segment_sizes(1)
    slot = layout.slot_bytes
    tensors = [{"name": t.name, "bytes": t.padded} for t in layout.tensors]
    points = []
    for workers, k in s.shard_configs:
        specs = [{"mode": "sharding", "rank": r, "world": workers, "servers": k, "segments": segments,
                  "stripe_unit": s.shard_stripe_unit, "placements": ["striped", "layered"],
                  "steps": s.shard_steps, "warmup": s.shard_warmup, "tag": f"shard/w{workers}",
                  "log_level": s.log_level} for r in range(workers)]
        runs = tb.run_workers(specs, hosts=tb.workers[:workers], name=f"shard-w{workers}-")
        point: dict[str, Any] = {"workers": workers, "servers": k}
        for placement in ("striped", "layered"):
            share = max(runs[0][placement]["servers"].values()) / slot
            point[placement] = {
                "step_seconds": statistics.median(_max_per_step(runs, placement, "step")),
                "push_seconds": statistics.median(_max_per_step(runs, placement, "push")),
                "pull_seconds": statistics.median(_max_per_step(runs, placement, "pull")),
                "steps": _max_per_step(runs, placement, "step"),
                "max_server_share": share,
                "cpu": _usage(cpu, [r[placement]["window"] for r in runs]),
                "verified": all(r[placement]["verified"] for r in runs)}
        point["speedup"] = point["layered"]["step_seconds"] / point["striped"]["step_seconds"]
        point["expected_speedup"] = point["layered"]["max_server_share"] / point["striped"]["max_server_share"]
        points.append(point)
        tick(f"sharding, {workers} workers / {k} server{'s' if k > 1 else ''}: "
             f"striped {point['striped']['step_seconds']:.2f} s, layered "
             f"{point['layered']['step_seconds']:.2f} s per step")
    return {"model": {"layers": [s.model_inputs, s.model_hidden, s.model_hidden, s.model_hidden, 10],
                      "bytes": slot, "largest_share": max(segments) / slot, "tensors": tensors},
            "steps": s.shard_steps, "warmup": s.shard_warmup, "points": points}


# -- experiment 3: aggregation ------------------------------------------------------
def allreduce(s: Settings, tick: Tick, cpu: CpuSampler | None = None) -> dict[str, Any]:
    """Gradient synchronization: memory-box accumulate-then-read, memory-box pipelined
    push-pull (:class:`smb_client.Collective`) and gloo all-reduce, on the same hosts.
    First ``s.sync_workers`` workers each on a host that also runs a memory server
    (``points``), then workers and memory servers on hosts of their own
    (``dedicated``: one point per (workers, servers) and size)."""
    n = s.sync_workers
    points = _allreduce_points(s, tick, cpu, n, n, colocate=True)
    dedicated = []
    for workers, servers in s.sync_dedicated:
        dedicated += _allreduce_points(s, tick, cpu, workers, servers, colocate=False)
    return {"workers": n, "syncs": s.syncs, "warmup": s.sync_warmup, "stripe_unit": MiB,
            "link_MBps": s.cap_mbit / 8, "points": points, "dedicated": dedicated}


def mixed(s: Settings, tick: Tick, cpu: CpuSampler | None = None) -> dict[str, Any]:
    """Experiment 3 with some memory servers on the first workers' hosts and the others
    on hosts of their own: the pipelined push-pull with chunks dealt evenly over the
    servers, and shared by spare link capacity (:func:`smb_protocol.placement.chunk_shares`,
    from every worker's host), beside gloo on the same hosts."""
    points = []
    for workers, servers, shared in s.sync_mixed:
        points += _allreduce_points(s, tick, cpu, workers, servers, colocate=shared, weighted=True)
    return {"syncs": s.syncs, "warmup": s.sync_warmup, "link_MBps": s.cap_mbit / 8, "points": points}


def _allreduce_points(s: Settings, tick: Tick, cpu: CpuSampler | None, n: int, k: int,
                      colocate: bool | int, weighted: bool = False) -> list[dict[str, Any]]:
    points = []
    with Testbed(k, n, colocate=colocate, cap_mbit=s.cap_mbit, log_level=s.log_level,
                 capacity=f"{max(256, 4 * max(s.sync_sizes) * max(1, n // k) // k // MiB + 64)}M") as tb:
        where = "co-located" if colocate is True else f"({tb.shared} co-located)" if tb.shared else "dedicated"
        for size in s.sync_sizes:
            specs = [{"mode": "allreduce", "rank": r, "world": n, "sizes": [size], "syncs": s.syncs,
                      "warmup": s.sync_warmup, "servers": k, "stripe_unit": MiB,
                      "master": tb.workers[0].address, "master_port": MASTER_PORT, "tag": f"ar{size}",
                      "log_level": s.log_level,
                      "worker_hosts": [h.ns for h in tb.workers] if weighted else None} for r in range(n)]
            samples = tb.workdir / f"links-{size}.jsonl"
            with tb.monitor_links(samples) as sampled:
                runs = tb.run_workers(specs, name=f"ar-{size}-")
            point: dict[str, Any] = {"bytes": size, "workers": n, "servers": k, "colocated": colocate,
                                     "shared_hosts": tb.shared}
            systems = ("smb", "collective", "pushpull", "bf16", "gloo") + (("weighted",) if weighted else ())
            for system in systems:
                per_sync = [max(r[str(size)][system]["times"][i] for r in runs)
                            for i in range(s.syncs)]
                span = _common([r[str(size)][system]["window"] for r in runs])
                usage = cpu.usage(*span) if cpu is not None else None
                per_gb = (span[1] - span[0]) / (size * s.syncs / 1e9)   # seconds of the span per GB of gradient
                point[system] = {"seconds": statistics.median(per_sync), "syncs": per_sync, "cpu": usage,
                                 "window": span,
                                 "cpu_per_gb": usage["cores"] * per_gb if usage else None,
                                 "cpu_per_gb_by_role": {role: cores * per_gb
                                                        for role, cores in usage.get("roles", {}).items()}
                                 if usage else None,
                                 "verified": all(r[str(size)][system]["verified"] for r in runs)}
            point["links"] = _links(samples, s.cap_mbit, sampled, tb, runs, size)
            point["smb"]["phases"] = {   # slowest worker per sync, median over syncs
                phase: statistics.median(max(r[str(size)]["smb"]["phases"][i][phase] for r in runs)
                                         for i in range(s.syncs))
                for phase in ("accumulate", "barrier", "read")}
            point["transports"] = runs[0][str(size)]["smb"]["transports"]
            point["smb_vs_gloo"] = point["gloo"]["seconds"] / point["smb"]["seconds"]
            point["collective_vs_gloo"] = point["gloo"]["seconds"] / point["collective"]["seconds"]
            point["pushpull_vs_gloo"] = point["gloo"]["seconds"] / point["pushpull"]["seconds"]
            point["bf16_vs_gloo"] = point["gloo"]["seconds"] / point["bf16"]["seconds"]
            point["bf16_of_collective"] = point["bf16"]["seconds"] / point["collective"]["seconds"]
            if weighted:
                point["weighted_vs_gloo"] = point["gloo"]["seconds"] / point["weighted"]["seconds"]
                point["weighted_bytes_per_server"] = runs[0][str(size)]["weighted"]["bytes_per_server"]
                point["even_bytes_per_server"] = runs[0][str(size)]["collective"]["bytes_per_server"]
                point["server_hosts"] = {info["server_id"]: tb.servers[i].ns for i, info in enumerate(tb.server_info)}
                point["worker_hosts"] = [h.ns for h in tb.workers]
            points.append(point)
            tick(f"aggregation, {n} workers, {k} {where} servers, {size / 1e6:.0f} MB: smb "
                 f"{point['smb']['seconds']:.2f} s, collective {point['collective']['seconds']:.2f} s, "
                 f"push-pull {point['pushpull']['seconds']:.2f} s, bf16 on the wire {point['bf16']['seconds']:.2f} s, "
                 f"gloo {point['gloo']['seconds']:.2f} s"
                 + (f", weighted push-pull {point['weighted']['seconds']:.2f} s" if weighted else ""))
    return points


def _links(samples: Path, cap_mbit: float, sampled: Sequence[Any], tb: Testbed,
           runs: Sequence[dict[str, Any]], size: int) -> dict[str, Any] | None:
    """The link figures of each system's measured rounds (:mod:`.links`): a round spans
    from the first worker's start to the last worker's end."""
    if not cap_mbit or not samples.exists():
        return None
    spans: dict[str, list[list[float]]] = {}
    for system in ("collective", "pushpull", "gloo"):
        per_worker = [r[str(size)][system].get("spans") or [] for r in runs]
        spans[system] = [[min(w[i][0] for w in per_worker), max(w[i][1] for w in per_worker)]
                         for i in range(min(len(w) for w in per_worker))]
    workers = [h.role for h in tb.workers]
    box = sorted({h.role for h in sampled})
    return links.summarize(samples, cap_mbit, [h.role for h in sampled], spans,
                           {"collective": box, "pushpull": box, "gloo": workers})


# -- failure ------------------------------------------------------------------------
def _wait_file(path: Path, timeout: float, proc: subprocess.Popen, tb: Testbed, name: str) -> Any:
    try:
        return wait_for_json(path, timeout, proc, FILE_POLL)
    except ChildProcessError:
        raise TestbedError(f"{name} exited with {proc.returncode} before {path.name}:\n"
                           + tb.log_tail(name)) from None
    except TimeoutError:
        raise TestbedError(f"no {path.name} from {name} within {timeout:.0f} s:\n" + tb.log_tail(name)) from None


def link_failure(tb: Testbed, *, io_timeout: float | None = None, size: int = MiB, max_wait: float = 30.0,
                 rejoin_timeout: float = 30.0, log_level: str = "WARNING") -> dict[str, Any]:
    """A worker reads region ``a`` in a loop; the link of ``a``'s memory server goes down
    (``ip link set eth0 down`` in its namespace) and, once the worker has seen the
    error, comes back. ``io_timeout``: the client's option (None: its default, so the
    error comes from the tcp transport's dead-peer detection). Every wait is bounded
    (seconds)."""
    sig = tb.workdir / "failure"
    sig.mkdir(exist_ok=True)
    for f in sig.iterdir():
        f.unlink()
    spec = {"mode": "failure", "signal_dir": str(sig), "io_timeout": io_timeout,
            "lease_seconds": tb.lease_seconds, "size": size, "b_ops": 5, "max_wait": max_wait,
            "rejoin_timeout": rejoin_timeout, "tag": "fail", "log_level": log_level}
    proc, out = tb.start_worker(tb.workers[0], "failure", spec)
    host = None
    try:
        ready = _wait_file(sig / "ready.json", 60.0, proc, tb, "failure")
        host = tb.server_host(ready["a"])
        time.sleep(1.0)                       # let the reads run
        down = time.time()
        tb.link_down(host)
        signal_files.write(sig / "down.json", {"time": down})
        _wait_file(sig / "error.json", max_wait + 3 * tb.lease_seconds + 10, proc, tb, "failure")
        up = time.time()
        tb.link_up(host)
        signal_files.write(sig / "up.json", {"time": up})
        result = tb.wait_worker("failure", proc, out, timeout=2 * rejoin_timeout + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if host is not None:
            tb.link_up(host)
    result["server_host"] = host.role
    result["server_address"] = host.address
    result["qdisc_after"] = tb.qdiscs(host)
    return result


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def failure(s: Settings, tick: Tick) -> dict[str, Any]:
    with Testbed(2, 1, cap_mbit=s.cap_mbit, lease_seconds=s.lease_seconds, log_level=s.log_level) as tb:
        result = link_failure(tb, io_timeout=s.io_timeout, log_level=s.log_level)
    err = result.get("error") or {}
    tick(f"failure: {err.get('type', 'no error')} after {_seconds(err.get('after_down_seconds'))}, "
         f"server up again after {_seconds(result.get('rejoined_after_seconds'))}")
    return result


# -- all ----------------------------------------------------------------------------
def points(s: Settings) -> int:
    """How many progress ticks :func:`run_all` makes."""
    n = 0
    n += len(s.server_counts) if "bandwidth" in s.only else 0
    n += len(s.shard_configs) if "sharding" in s.only else 0
    n += len(s.sync_sizes) * (1 + len(s.sync_dedicated)) if "allreduce" in s.only else 0
    n += len(s.sync_sizes) * len(s.sync_mixed) if "mixed" in s.only else 0
    n += 1 if "failure" in s.only else 0
    n += 2 if "replication" in s.only else 0
    n += 1 if "training" in s.only else 0
    n += weights.points(s) if "weights" in s.only else 0
    return n


def run_all(s: Settings, tick: Tick) -> dict[str, Any]:
    """Every experiment in ``s.only``, each on its own testbed(s)."""
    out: dict[str, Any] = {"settings": asdict(s)}
    with CpuSampler(live_pids) as cpu:
        if "bandwidth" in s.only or "sharding" in s.only:
            servers = max([*s.server_counts, *(k for _, k in s.shard_configs)])
            workers = max([s.clients, *(w for w, _ in s.shard_configs)])
            with Testbed(servers, workers, cap_mbit=s.cap_mbit, log_level=s.log_level) as tb:
                if "bandwidth" in s.only:
                    out["bandwidth"] = bandwidth(tb, s, tick, cpu)
                if "sharding" in s.only:
                    out["sharding"] = sharding(tb, s, tick, cpu)
        if "allreduce" in s.only:
            out["allreduce"] = allreduce(s, tick, cpu)
        if "mixed" in s.only:
            out["mixed"] = mixed(s, tick, cpu)
        if "failure" in s.only:
            out["failure"] = failure(s, tick)
        if "replication" in s.only:
            out["replication"] = replica_failure.run(s, tick)
        if "training" in s.only:
            out["training"] = training.run(s, tick, cpu)
        if "weights" in s.only:
            out["weights"] = weights.run(s, tick)
    return out


def quick(**overrides: Any) -> Settings:
    return replace(QUICK, **overrides)
