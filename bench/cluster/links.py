"""Per-link timelines of the all-reduce experiments: how busy every host's link was.

:meth:`.testbed.Testbed.monitor_links` samples the switch's port counters
(:mod:`.linkmon`) while the workers run. Each system's rounds are known by their spans
(``time.time()`` at the start and end of every measured round, per worker); here the
samples are cut to those spans and turned into utilisation: bytes per sample interval
over what the link cap carries in that interval, per host and direction (*up*: what
the host sent, *down*: what it received).

Figures per system (all measured rounds):

* ``mean``: the mean utilisation of the links that carry traffic in the system's
  pattern (every worker link both ways; with dedicated servers every server link both
  ways too), over the rounds;
* ``steady``: the same over the middle 80% of each round (the start, before the first
  bytes come back, and the tail are left out);
* ``idle``: the fraction of (link, sample) pairs below 20% of capacity in the rounds.

``timeline``: the first measured round of each system, for the plot.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IDLE = 0.2          # below this fraction of capacity a link counts as idle
STEADY = (0.1, 0.9)  # the part of a round counted as steady state


def load(path: Path) -> tuple[list[str], float, list[float], list[list[list[int]]]]:
    """(ports, interval, times, counters[sample][port] = [rx, tx]) of a linkmon file."""
    lines = Path(path).read_text().splitlines()
    head = json.loads(lines[0])
    times, counters = [], []
    for line in lines[1:]:
        try:
            t, c = json.loads(line)
        except ValueError:   # a line cut by the stop
            continue
        times.append(float(t))
        counters.append(c)
    return head["ports"], float(head["interval"]), times, counters


def rates(times: list[float], counters: list[list[list[int]]], cap_bytes: float
          ) -> tuple[list[float], list[list[float]], list[list[float]]]:
    """(mid-times, up[port][i], down[port][i]) as fractions of ``cap_bytes`` per second."""
    mids: list[float] = []
    ports = len(counters[0]) if counters else 0
    up: list[list[float]] = [[] for _ in range(ports)]
    down: list[list[float]] = [[] for _ in range(ports)]
    for i in range(1, len(times)):
        dt = times[i] - times[i - 1]
        if dt <= 0:
            continue
        mids.append((times[i] + times[i - 1]) / 2)
        for p in range(ports):
            up[p].append((counters[i][p][0] - counters[i - 1][p][0]) / dt / cap_bytes)
            down[p].append((counters[i][p][1] - counters[i - 1][p][1]) / dt / cap_bytes)
    return mids, up, down


def summarize(path: Path, cap_mbit: float, roles: Sequence[str], spans: dict[str, list[list[float]]],
              busy: dict[str, Sequence[str]]) -> dict[str, Any]:
    """The figures of every system in ``spans`` (system -> [[start, end], ...] of its
    measured rounds, slowest worker); ``busy``: per system, the roles whose links carry
    its traffic."""
    ports, interval, times, counters = load(path)
    mids, up, down = rates(times, counters, cap_mbit * 1e6 / 8)
    index = {p: i for i, p in enumerate(ports)}
    out: dict[str, Any] = {"interval": interval, "roles": [r for r in roles if r in index]}
    for system, rounds in spans.items():
        carry = [index[r] for r in busy[system] if r in index]
        every, steady = [], []
        for t0, t1 in rounds:
            a, b = t0 + STEADY[0] * (t1 - t0), t0 + STEADY[1] * (t1 - t0)
            for i, t in enumerate(mids):
                if t0 <= t <= t1:
                    values = [up[p][i] for p in carry] + [down[p][i] for p in carry]
                    every += values
                    if a <= t <= b:
                        steady += values
        first = rounds[0] if rounds else None
        timeline = None
        if first is not None:
            keep = [i for i, t in enumerate(mids) if first[0] - interval <= t <= first[1] + interval]
            timeline = {"t": [round(mids[i] - first[0], 4) for i in keep],
                        "dt": [round(times[i + 1] - times[i], 4) for i in keep],   # each sample's interval
                        "up": {r: [round(up[index[r]][i], 3) for i in keep] for r in out["roles"]},
                        "down": {r: [round(down[index[r]][i], 3) for i in keep] for r in out["roles"]},
                        "seconds": first[1] - first[0]}
        out[system] = {"mean": statistics.fmean(every) if every else None,
                       "steady": statistics.fmean(steady) if steady else None,
                       "idle": sum(v < IDLE for v in every) / len(every) if every else None,
                       "samples": len(every), "timeline": timeline}
    return out


def table(points: Sequence[dict[str, Any]], systems: Sequence[str]) -> str:
    """Markdown: per point and system, the time, the ratio to gloo and the links' use."""
    lines = ["| workers | servers | placement | size | system | seconds | gloo / system "
             "| links, mean | links, steady state | samples under 20% | CPU s per GB "
             "| of which servers, workers |",
             "| ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        links = p.get("links") or {}
        where = "co-located" if p.get("colocated") is True else (
            f"{p.get('shared_hosts')} co-located" if p.get("shared_hosts") else "dedicated")
        for system in systems:
            if system not in p:
                continue
            s, ln = p[system], links.get(system) or {}
            ratio = p["gloo"]["seconds"] / s["seconds"] if s["seconds"] else None
            lines.append(
                f"| {p['workers']} | {p['servers']} | {where} | {p['bytes'] / 1e6:.0f} MB | {system} "
                f"| {s['seconds']:.2f} | {_f(ratio)} | {_f(ln.get('mean'))} | {_f(ln.get('steady'))} "
                f"| {_f(ln.get('idle'))} | {_f(s.get('cpu_per_gb'))} | {_roles(s.get('cpu_per_gb_by_role'))} |")
    return "\n".join(lines) + "\n"


def _roles(by_role: dict[str, float] | None) -> str:
    """The servers' and the workers' part of a point's CPU per GB ('-': not split)."""
    if not by_role:
        return "-"
    return f"{by_role.get('servers', 0.0):.1f}, {by_role.get('workers', 0.0):.1f}"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(point: dict[str, Any], systems: Sequence[str], path: str, title: str) -> None:
    """One panel per system: every host link's utilisation over its first measured
    round, uplink solid, downlink dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = point.get("links") or {}
    shown = [s for s in systems if (links.get(s) or {}).get("timeline")]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.8 * len(shown)), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, system in zip(axes[:, 0], shown, strict=True):
        tl = links[system]["timeline"]
        for k, role in enumerate(links["roles"]):
            c = colors[k % len(colors)]
            ax.plot(tl["t"], tl["up"][role], color=c, lw=1, label=f"{role} up")
            ax.plot(tl["t"], tl["down"][role], color=c, lw=1, ls="--", label=f"{role} down")
        ax.axvline(tl["seconds"], color="k", lw=0.8)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("of link cap")
        ln = links[system]
        ax.set_title(f"{system}: round {tl['seconds']:.2f} s, links {_f(ln.get('mean'))} busy on average, "
                     f"{_f(ln.get('steady'))} in steady state", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the round's start (vertical line: its end, slowest worker)")
    axes[0, 0].legend(fontsize=6, ncol=4, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
