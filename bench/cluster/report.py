"""Tables (Markdown) and plots (PNG) of the cluster experiments' results.

Input is the dict :func:`bench.cluster.experiments.run_all` returns. Bandwidths are
MB/s (1e6 bytes per second), times seconds.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from . import links, training, weights

log = logging.getLogger(__name__)

SCALING_TARGET = 0.85      # aggregate bandwidth / linear scaling, while links are the bottleneck
EXPERIMENT_KEYS = ("bandwidth", "sharding", "allreduce", "failure", "replication", "training", "weights")
REPLICATION_ACCURACY_SLACK = 0.02   # test accuracy: run with the kill vs undisturbed (asynchronous SEASGD)


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _cores(usage: dict[str, float] | None) -> str:
    """The testbed's CPU use as cores (of the machine's)."""
    return "-" if not usage else f"{usage['cores']:.2f}"


def bandwidth_table(r: dict[str, Any]) -> str:
    lines = ["| memory servers | write (MB/s) | vs linear | of link capacity | read (MB/s) | vs linear "
             "| of link capacity | CPU cores used (write, read) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r["points"]:
        lines.append(
            f"| {p['servers']} | {p['write_MBps']:.1f} | {_f(p['write_scaling'])} | {_f(p['write_of_links'])} "
            f"| {p['read_MBps']:.1f} | {_f(p['read_scaling'])} | {_f(p['read_of_links'])} "
            f"| {_cores(p['write_cpu'])}, {_cores(p['read_cpu'])} |")
    return "\n".join(lines) + "\n"


def sharding_table(r: dict[str, Any]) -> str:
    lines = ["| workers | memory servers | striped step (s) | layered step (s) | speedup striped over layered "
             "| expected from placement | busiest server's share, striped / layered "
             "| CPU cores used (striped, layered) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r["points"]:
        st, la = p["striped"], p["layered"]
        lines.append(
            f"| {p['workers']} | {p['servers']} | {st['step_seconds']:.3f} | {la['step_seconds']:.3f} "
            f"| {p['speedup']:.2f} | {p['expected_speedup']:.2f} "
            f"| {st['max_server_share']:.2f} / {la['max_server_share']:.2f} "
            f"| {_cores(st.get('cpu'))}, {_cores(la.get('cpu'))} |")
    return "\n".join(lines) + "\n"


def link_bound(r: dict[str, Any], size: int) -> float | None:
    """Seconds a synchronization of ``size`` bytes takes at least when links are the limit:
    every host sends and receives 2(n-1)/n of it, in a ring and, with a memory server on
    every host, through the memory box as well."""
    n, rate = r["workers"], r.get("link_MBps")
    return 2 * (n - 1) / n * size / (rate * 1e6) if rate else None


def allreduce_table(r: dict[str, Any]) -> str:
    lines = ["| gradient size | memory box, accumulate then read (s) | memory box, pipelined push-pull (s) "
             "| gloo all-reduce (s) | gloo time / memory-box time (accumulate-read, push-pull) "
             "| link bound (s) | CPU cores used (accumulate-read, push-pull, gloo) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r["points"]:
        coll = p.get("collective")
        lines.append(
            f"| {p['bytes'] / 1e6:.0f} MB | {p['smb']['seconds']:.2f} "
            f"| {_f(coll['seconds'] if coll else None)} | {p['gloo']['seconds']:.2f} "
            f"| {p['smb_vs_gloo']:.2f}, {_f(p.get('collective_vs_gloo'))} | {_f(link_bound(r, p['bytes']))} "
            f"| {_cores(p['smb'].get('cpu'))}, {_cores(coll.get('cpu') if coll else None)}, "
            f"{_cores(p['gloo'].get('cpu'))} |")
    return "\n".join(lines) + "\n"


def dedicated_bounds(r: dict[str, Any], p: dict[str, Any]) -> tuple[float | None, float | None]:
    """(memory box, ring) link bounds in seconds for a point with dedicated memory
    servers: a worker sends and receives the gradient once, a server ``n/k`` of it, so
    the memory box needs ``max(1, n/k) × size`` on the busiest link; the ring
    ``2(n-1)/n × size`` on every link."""
    rate = r.get("link_MBps")
    if not rate:
        return None, None
    n, k, size = p["workers"], p["servers"], p["bytes"]
    return max(1.0, n / k) * size / (rate * 1e6), 2 * (n - 1) / n * size / (rate * 1e6)


def dedicated_table(r: dict[str, Any]) -> str:
    lines = ["| workers | memory servers | gradient size | accumulate then read (s) | pipelined push-pull (s) "
             "| the same, bf16 on the wire (s) "
             "| gloo all-reduce (s) | gloo time / memory-box time (accumulate-read, push-pull) "
             "| link bound: memory box, ring (s) | expected ratio at the link bound "
             "| CPU cores used (accumulate-read, push-pull, gloo) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r.get("dedicated", []):
        box, ring = dedicated_bounds(r, p)
        bf16 = p.get("bf16", {}).get("seconds")
        lines.append(
            f"| {p['workers']} | {p['servers']} | {p['bytes'] / 1e6:.0f} MB | {p['smb']['seconds']:.2f} "
            f"| {p['collective']['seconds']:.2f} | {_f(bf16)} | {p['gloo']['seconds']:.2f} "
            f"| {p['smb_vs_gloo']:.2f}, {p['collective_vs_gloo']:.2f} | {_f(box)}, {_f(ring)} "
            f"| {_f(ring / box if box and ring else None)} "
            f"| {_cores(p['smb'].get('cpu'))}, {_cores(p['collective'].get('cpu'))}, "
            f"{_cores(p['gloo'].get('cpu'))} |")
    return "\n".join(lines) + "\n"


def mixed_bounds(r: dict[str, Any], p: dict[str, Any], key: str) -> float | None:
    """Seconds the busiest link needs for point ``p`` of the mixed experiment with the
    chunks dealt as measured (``key``: even_bytes_per_server or
    weighted_bytes_per_server): :func:`smb_protocol.placement.host_loads` of the shares."""
    from smb_protocol.placement import host_loads
    rate, per_server = r.get("link_MBps"), p.get(key) or {}
    total = sum(per_server.values())
    if not rate or not total:
        return None
    loads = host_loads({sid: b / total for sid, b in per_server.items()}, p["server_hosts"], p["worker_hosts"])
    return max(loads.values()) * p["bytes"] / (rate * 1e6)


def _share_on(p: dict[str, Any], key: str, servers: set[str]) -> str:
    """The fraction of point ``p``'s bytes (``key``) that ``servers`` sum."""
    per = p.get(key) or {}
    total = sum(per.values())
    return f"{sum(b for sid, b in per.items() if sid in servers) / total:.2f}" if total else "-"


def mixed_table(r: dict[str, Any]) -> str:
    lines = ["| workers | memory servers (on workers' hosts) | gradient size | push-pull, even shares (s) "
             "| push-pull, shares by spare link capacity (s) | gloo all-reduce (s) "
             "| gloo time / memory-box time (even, by capacity) | link bound: even, by capacity, ring (s) "
             "| share of the bytes on the co-located servers (even, by capacity) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r.get("points", []):
        rate = r.get("link_MBps")
        n = p["workers"]
        ring = 2 * (n - 1) / n * p["bytes"] / (rate * 1e6) if rate else None
        shared = {sid for sid, h in p["server_hosts"].items() if h in set(p["worker_hosts"])}
        lines.append(
            f"| {n} | {p['servers']} ({p['shared_hosts']}) | {p['bytes'] / 1e6:.0f} MB "
            f"| {p['collective']['seconds']:.2f} | {p['weighted']['seconds']:.2f} | {p['gloo']['seconds']:.2f} "
            f"| {p['collective_vs_gloo']:.2f}, {p['weighted_vs_gloo']:.2f} "
            f"| {_f(mixed_bounds(r, p, 'even_bytes_per_server'))}, "
            f"{_f(mixed_bounds(r, p, 'weighted_bytes_per_server'))}, {_f(ring)} "
            f"| {_share_on(p, 'even_bytes_per_server', shared)}, "
            f"{_share_on(p, 'weighted_bytes_per_server', shared)} |")
    return "\n".join(lines) + "\n"


def failure_table(r: dict[str, Any]) -> str:
    err = r.get("error") or {}
    retry = r.get("retry_error") or {}
    other = r.get("other_region") or {}
    io = "default" if r["io_timeout"] is None else f"{r['io_timeout']:g} s"
    lines = ["| what | measured |", "| --- | --- |",
             f"| client's error after the link went down | {err.get('type', 'none')} after "
             f"{_f(err.get('after_down_seconds'))} s (`{err.get('message', '')}`) |",
             f"| the next operation on it (a new connection) | {retry.get('type', 'none')} after "
             f"{_f(retry.get('op_seconds'))} s |",
             f"| bound: client io timeout, dead-peer timeout / controller lease | {io}, "
             f"{r['dead_peer_timeout']:g} s / {r['lease_seconds']:g} s |",
             f"| region on the other server meanwhile | {'works' if other.get('ok') else 'FAILED'} "
             f"({other.get('ops', 0)} writes and reads, {_f(other.get('seconds'))} s) |",
             f"| controller marks the server down after | {_f(r.get('marked_down_after_seconds'))} s |",
             f"| link up → controller lists the server up after | {_f(r.get('rejoined_after_seconds'))} s |",
             f"| link up → the region is readable again after | {_f(r.get('recovered_after_seconds'))} s "
             f"(data intact: {'yes' if r.get('data_intact') else 'NO'}) |"]
    return "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def replication_table(r: dict[str, Any]) -> str:
    """The replication experiment: both runs' accuracy, then the failure's measures."""
    sm = r.get("summary") or {}
    base, kill = sm.get("undisturbed") or {}, sm.get("kill") or {}
    f = sm.get("failure") or {}
    lines = ["| what | measured |", "| --- | --- |",
             "| test accuracy of the global weights: undisturbed / server killed | "
             f"{_f(base.get('accuracy'), '{:.3f}')} / {_f(kill.get('accuracy'), '{:.3f}')} |",
             f"| training time (slowest worker): undisturbed / server killed | {_s(base.get('seconds'))} / "
             f"{_s(kill.get('seconds'))} |"]
    for name, label in (("undisturbed", "undisturbed run"), ("kill", "run with the kill")):
        err = (r.get(name) or {}).get("error")
        if err:
            lines.append(f"| {label} | FAILED: {err.splitlines()[0].rstrip(':')}: "
                         f"`{err.strip().splitlines()[-1].strip()}` |")
    if not f:
        return "\n".join(lines) + "\n"
    v = f.get("victim") or {}
    lines.append(f"| memory server killed (SIGKILL) | {f['killed_host']}, primary of the {v.get('region', '?')} "
                 f"region{' and of a slot of the global weights' if v.get('region') == 'counters' else ''} |")
    lines.append(f"| controller lists it `down` after | {_s(f.get('marked_down_after'))} |")
    lines.append("| time to detect: first replica-set change (controller log) or `degraded` seen, after | "
                 f"{_s(f.get('degraded_after'))} |")
    lines.append(f"| first backup promoted to primary after (controller log) | {_s(f.get('promoted_after'))} "
                 f"({f.get('promotions') or 0} slots promoted) |")
    probe = f.get("first_op_at_new_primary_after")
    lines.append("| first mutation completed at the promoted primary after | "
                 + (_s(probe) if probe is not None else f"none ({f.get('probe_error') or 'no probe'})") + " |")
    lines.append(f"| time degraded (until every region `ready`, no copy on the killed server) | "
                 f"{_s(f.get('degraded_seconds'))} (`ready` {_s(f.get('ready_after'))} after the kill) |")
    rep = f.get("repair") or {}
    moved = rep.get("bytes")
    busy = (f"{_s(rep['copy_seconds'])} copying (summed over {rep.get('copies')} copies, up to 4 at once), "
            if rep.get("copy_seconds") is not None else "")
    lines.append(f"| repair: bytes copied, time spent copying, bandwidth while copying; span | "
                 f"{'-' if not moved else f'{moved / 1e6:.2f} MB'}, {busy}"
                 f"{_f(rep.get('MBps'), '{:.1f} MB/s')}; {_s(rep.get('seconds'))} "
                 f"({rep.get('source', '')}) |")
    stalls = [x for x in f.get("stalls", []) if x.get("longest_step") is not None]
    if stalls:
        lines.append("| longest step per worker during the failure (median step before) | "
                     + ", ".join(f"rank {x['rank']}: {x['longest_step']:.2f} s ({_f(x['median_step'], '{:.3f}')} s)"
                                 for x in stalls) + " |")
    c = f.get("counters") or {}
    lines.append(f"| copies identical after the repair | {'yes' if f.get('copies_identical') else 'NO'} "
                 f"({_f((f.get('copies_bytes_compared') or 0) / 1e6, '{:.2f}')} MB compared, "
                 f"{f.get('copies_differing_bytes')} bytes differ) |")
    lines.append(f"| global weights vs initial + every pushed delta | largest difference "
                 f"{_f(f.get('weights_max_abs_error'), '{:.1e}')}; one delta lost or applied twice would "
                 f"differ by at least {_f(f.get('smallest_delta'), '{:.1e}')} |")
    lines.append(f"| iteration counters | total word {c.get('total_word')}, sum of the workers' words "
                 f"{c.get('sum_of_counts')}, steps the workers took {sum(c.get('worker_steps') or [])}, "
                 f"finished {c.get('finished_word')}: "
                 f"{'consistent' if f.get('counters_consistent') else 'NOT consistent'} |")
    lost = f.get("bytes_lost")
    lines.append(f"| bytes lost | {'0' if lost == 0 else 'not shown to be 0 (see the rows above)'} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    parts = [f"Links capped at {s['cap_mbit']:g} Mbit/s each direction "
             f"({s['cap_mbit'] / 8:g} MB/s); MB = 1e6 bytes.\n"]
    if "bandwidth" in results:
        b = results["bandwidth"]
        parts.append(f"**Bandwidth scaling**: {b['clients']} clients, {b['op_bytes'] >> 20} MiB per operation, "
                     f"{b['seconds']:g} s per direction\n")
        parts.append(bandwidth_table(b))
    if "sharding" in results:
        m = results["sharding"]["model"]
        parts.append(f"**Sharding**: MLP {'-'.join(str(x) for x in m['layers'])}, {m['bytes'] / 1e6:.1f} MB "
                     f"of parameters, {100 * m['largest_share']:.0f}% in the first layer; median of "
                     f"{results['sharding']['steps']} steps\n")
        parts.append(sharding_table(results["sharding"]))
    if "allreduce" in results:
        a = results["allreduce"]
        parts.append(f"**Aggregation**: {a['workers']} workers, each host also a memory server; median of "
                     f"{a['syncs']} synchronizations\n")
        parts.append(allreduce_table(a))
        if a.get("dedicated"):
            parts.append(f"**Aggregation, memory servers on hosts of their own**: median of {a['syncs']} "
                         "synchronizations\n")
            parts.append(dedicated_table(a))
        every = a["points"] + a.get("dedicated", []) + results.get("mixed", {}).get("points", [])
        if any(p.get("links") for p in every):
            parts.append("**Aggregation, link use** (:mod:`bench.cluster.links`): collective = streamed "
                         "sums, pushpull = a push and a pull per chunk as before them\n")
            parts.append(links.table(every, ("collective", "pushpull", "gloo")))
    if results.get("mixed", {}).get("points"):
        parts.append(f"**Aggregation, some memory servers on workers' hosts**: median of "
                     f"{results['mixed']['syncs']} synchronizations\n")
        parts.append(mixed_table(results["mixed"]))
    if "failure" in results:
        parts.append("**Failure**: a memory server's link goes down mid-run\n")
        parts.append(failure_table(results["failure"]))
    if "replication" in results:
        r = results["replication"]
        parts.append(f"**Replication**: SEASGD (digits), {r['workers']} workers, {r['servers']} memory servers, "
                     f"store with replicas={r['replicas']}; a memory server killed (SIGKILL) at "
                     f"{100 * r['kill_fraction']:.0f}% of the iterations\n")
        parts.append(replication_table(r))
    if "training" in results:
        parts.append(training.summary(results["training"]))
        parts.append(training.table(results["training"]))
    if "weights" in results:
        parts.append(weights.summary(results["weights"]))
        parts.append(weights.table(results["weights"]))
    return "\n".join(parts)


def targets(results: dict[str, Any]) -> list[str]:
    """Lines saying, per target, whether it was met."""
    out = []
    b = results.get("bandwidth")
    if b:
        for p in b["points"][1:]:
            for kind in ("write", "read"):
                v = p[f"{kind}_scaling"]
                ok = v is not None and v >= SCALING_TARGET
                out.append(f"{kind} scaling at {p['servers']} servers: {_f(v)} of linear "
                           f"(target {SCALING_TARGET}): {'met' if ok else 'NOT met'}")
    for name in ("sharding", "allreduce", "mixed"):
        for p in (results.get(name) or {}).get("points", []):
            checks = [p[x]["verified"] for x in ("striped", "layered", "smb", "collective", "weighted", "gloo")
                      if x in p]
            if not all(checks):
                out.append(f"{name}: data check FAILED at {p}")
    for p in (results.get("mixed") or {}).get("points", []):
        out.append(f"mixed ({p['workers']} workers, {p['servers']} servers, {p['shared_hosts']} on workers' "
                   f"hosts, {p['bytes'] / 1e6:.0f} MB): push-pull by spare capacity "
                   f"{p['collective']['seconds'] / p['weighted']['seconds']:.2f}x even shares, "
                   f"{p['weighted_vs_gloo']:.2f}x gloo")
    f = results.get("failure")
    if f:
        err = f.get("error") or {}
        ok = err.get("after_down_seconds") is not None and err["after_down_seconds"] <= f["lease_seconds"]
        out.append(f"failure: typed error within the lease: {'met' if ok else 'NOT met'}; server back up: "
                   f"{'yes' if f.get('rejoined_after_seconds') is not None else 'NO'}")
    r = results.get("replication")
    if r:
        sm = r.get("summary") or {}
        fl = sm.get("failure") or {}
        base, kill = (sm.get("undisturbed") or {}).get("accuracy"), (sm.get("kill") or {}).get("accuracy")
        same = base is not None and kill is not None and abs(base - kill) <= REPLICATION_ACCURACY_SLACK
        went_on = (sm.get("kill") or {}).get("ok")
        out.append(f"replication: training went on after the kill: {'yes' if went_on else 'NO'}; "
                   f"accuracy {_f(kill, '{:.3f}')} vs undisturbed {_f(base, '{:.3f}')}: "
                   f"{'same' if same else 'NOT the same'} (within {REPLICATION_ACCURACY_SLACK}); back to ready: "
                   f"{'yes' if fl.get('ready_after') is not None else 'NO'}; bytes lost 0: "
                   f"{'yes' if fl.get('bytes_lost') == 0 else 'NOT shown'}")
    if results.get("training"):
        out += training.targets(results["training"])
    if results.get("weights"):
        out += weights.targets(results["weights"])
    return out


# -- plots --------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_bandwidth(r: dict[str, Any], cap_mbit: float, path: str) -> None:
    plt = _pyplot()
    ks = [p["servers"] for p in r["points"]]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for kind, marker in (("write", "o"), ("read", "s")):
        ax.plot(ks, [p[f"{kind}_MBps"] for p in r["points"]], marker=marker, label=f"{kind}")
    base = (r["points"][0]["write_MBps"] + r["points"][0]["read_MBps"]) / 2 / ks[0]
    ax.plot(ks, [base * k for k in ks], ":", color="gray", label="linear (from 1 server)")
    if r.get("link_MBps"):
        ax.plot(ks, [r["link_MBps"] * k for k in ks], "--", color="black", lw=0.8,
                label=f"link capacity ({cap_mbit:g} Mbit/s per server)")
    ax.set_xticks(ks)
    ax.set_xlabel("memory servers (region striped over all)")
    ax.set_ylabel("aggregate MB/s")
    ax.set_title(f"{r['clients']} clients, {r['op_bytes'] >> 20} MiB operations")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_sharding(r: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    pts = r["points"]
    labels = [f"{p['workers']} workers\n{p['servers']} server{'s' if p['servers'] > 1 else ''}" for p in pts]
    x = range(len(pts))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [p["striped"]["step_seconds"] for p in pts], w, label="striped (memory-based)")
    ax.bar([i + w / 2 for i in x], [p["layered"]["step_seconds"] for p in pts], w, label="layered (layer-based)")
    for i, p in enumerate(pts):
        ax.annotate(f"×{p['speedup']:.2f}", (i, max(p["striped"]["step_seconds"], p["layered"]["step_seconds"])),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.margins(y=0.12)
    ax.set_ylabel("seconds per step (push gradients + pull parameters)")
    ax.set_title("step time, model with ~80% of its parameters in one layer", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_allreduce(r: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    pts = r["points"]
    x = range(len(pts))
    w = 0.26
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    ax.bar([i - w for i in x], [p["smb"]["seconds"] for p in pts], w, label="memory box: accumulate, read")
    if all("collective" in p for p in pts):
        ax.bar(list(x), [p["collective"]["seconds"] for p in pts], w, label="memory box: pipelined push-pull")
    ax.bar([i + w for i in x], [p["gloo"]["seconds"] for p in pts], w, label="gloo all-reduce")
    for i, p in enumerate(pts):
        bound = link_bound(r, p["bytes"])
        if bound:
            ax.hlines(bound, i - 1.2 * w, i + 1.2 * w, colors="black", linestyles="--", lw=0.8,
                      label="link bound, 2(n-1)/n of the bytes per link" if i == 0 else None)
    ax.set_xticks(list(x), [f"{p['bytes'] / 1e6:.0f} MB" for p in pts])
    ax.set_ylabel("seconds per synchronization")
    ax.set_title(f"gradient synchronization, {r['workers']} workers", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("wrote %s", path)


def _curve(run: dict[str, Any]) -> tuple[list[float], list[float], float | None]:
    """Rank 0's accuracy curve of a run: (seconds since the start, accuracy, start time)."""
    master = [w for w in run.get("workers", []) if w.get("rank") == 0]
    if not master:
        return [], [], None
    m = master[0]
    return [c[0] for c in m["curve"]], [c[2] for c in m["curve"]], m.get("start_time")


def plot_replication(r: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.0, 6.0), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for name, style in (("undisturbed", "-"), ("kill", "-")):
        xs, ys, _ = _curve(r.get(name) or {})
        if xs:
            label = "undisturbed" if name == "undisturbed" else "memory server killed"
            ax.plot(xs, ys, style, marker=".", ms=3, label=label)
    kill = r.get("kill") or {}
    killed = kill.get("killed")
    _, _, start = _curve(kill)
    f = (r.get("summary") or {}).get("failure") or {}
    if killed and start is not None:
        t = killed["time"] - start
        marks = [(t, "kill -9", "red")]
        if f.get("degraded_after") is not None:
            marks.append((t + f["degraded_after"], "degraded", "orange"))
        if f.get("ready_after") is not None:
            marks.append((t + f["ready_after"], "ready", "green"))
        for a in (ax, ax2):
            for x, label, color in marks:
                a.axvline(x, color=color, ls="--", lw=0.9, label=label if a is ax else None)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, w in enumerate(sorted(kill.get("workers", []), key=lambda w: w["rank"])):
            steps = w.get("step_log") or []   # each step a segment from its start to its end
            ax2.hlines([sec for _, sec, _ in steps], [e - sec - start for e, sec, _ in steps],
                       [e - start for e, _, _ in steps], colors=colors[i % len(colors)], lw=1.5,
                       label=f"rank {w['rank']}")
    ax.set_ylabel("test accuracy of the global weights")
    ax.set_title(f"SEASGD, {r['workers']} workers, {r['servers']} memory servers, replicas={r['replicas']}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax2.set_yscale("log")
    ax2.set_ylabel("step time (s), run with the kill")
    ax2.set_xlabel("seconds since the start of training")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7, ncol=4, loc="upper right")
    _save(fig, path)


def plots(results: dict[str, Any], png_dir: str, prefix: str = "cluster",
          only: tuple[str, ...] | None = None) -> list[str]:
    """Write the plots of the experiments present (and in ``only``, default all);
    returns their paths."""
    if only is not None:
        results = {k: v for k, v in results.items() if k not in EXPERIMENT_KEYS or k in only}
    cap = results["settings"]["cap_mbit"]
    written = []
    if "replication" in results:
        written.append(os.path.join(png_dir, f"{prefix}-replication.png"))
        plot_replication(results["replication"], written[-1])
    if "bandwidth" in results:
        written.append(os.path.join(png_dir, f"{prefix}-bandwidth.png"))
        plot_bandwidth(results["bandwidth"], cap, written[-1])
    if "sharding" in results:
        written.append(os.path.join(png_dir, f"{prefix}-sharding.png"))
        plot_sharding(results["sharding"], written[-1])
    if "allreduce" in results:
        written.append(os.path.join(png_dir, f"{prefix}-allreduce.png"))
        plot_allreduce(results["allreduce"], written[-1])
        every = results["allreduce"]["points"] + results["allreduce"].get("dedicated", [])
        largest = max((p["bytes"] for p in every), default=0)
        for p in every:   # one plot per placement, at the largest size
            if p.get("links") and p["bytes"] == largest:
                where = "colocated" if p.get("colocated") is True else "dedicated"
                written.append(os.path.join(png_dir, f"{prefix}-links-{p['workers']}x{p['servers']}-{where}.png"))
                links.plot(p, ("collective", "pushpull", "gloo"), written[-1],
                           f"{p['workers']} workers, {p['servers']} {where} memory servers, "
                           f"{p['bytes'] / 1e6:.0f} MB: per-link use over one round")
    if "training" in results:
        written.append(os.path.join(png_dir, f"{prefix}-training.png"))
        training.plot(results["training"], written[-1])
    return written
