"""The weights experiment: a trainer publishes versions of a state dict to readers on
other hosts (``smb_client.weights``), against ``torch.distributed.broadcast`` over gloo
from the same trainer to the same readers, in the same run.

``s.weights_servers`` memory servers and ``1 + s.weights_readers`` worker hosts, each
its own namespace with its link capped at ``s.cap_mbit``: the trainer on the first
worker host, a reader on each of the others (:mod:`.weights_worker`, one gloo group
over the same hosts, ``MASTER_ADDR`` the trainer's host). ``s.weights_mb`` MiB of
float32 in 16 MiB matrices, ``versions=3``, striped over every memory server. Per
round (``s.weights_warmup`` not counted, then ``s.weights_rounds``): seconds from the
start of ``publish`` until the last reader held the version, and of the broadcast
until the last reader had it; every reader checks the CRC-32 of what it got, each time.
Then one reader's full read against its 2-way row and column shard reads. Figures are
medians over the counted rounds; sizes MB = 1e6 bytes.
"""
from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .testbed import Testbed

log = logging.getLogger(__name__)

MASTER_PORT = 29500        # gloo's rendezvous on the trainer's host
VERSIONS = 3               # versions the publication keeps
BROADCAST_TARGET = 2.0     # publish -> all hold at least this many times faster than the broadcast
SHARD_TARGET = 0.55        # a 2-way shard read at most this fraction of the full read's time


def points(s: Any) -> int:
    """Progress lines :func:`run` prints: one per round and one for the shard reads."""
    return int(s.weights_warmup + s.weights_rounds + 1)


class _Progress:
    """Prints the lines the trainer appends to ``path`` as they come."""

    def __init__(self, path: Path, tick: Callable[[str], None], readers: int) -> None:
        self.path, self.tick, self.readers, self.seen = path, tick, readers, 0

    def __call__(self) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return
        for line in lines[self.seen:]:
            if not line.endswith("}"):       # being written
                break
            self.seen += 1
            d = json.loads(line)
            if d["kind"] == "round":
                self.tick(f"weights, round {d['round']}{' (warm-up)' if d['warmup'] else ''}: publish -> "
                          f"{self.readers} readers hold {d['publish_to_all_hold']:.2f} s (acknowledged after "
                          f"{d['publish_acked']:.2f} s), gloo broadcast {d['broadcast']:.2f} s, checksums "
                          f"{'match' if d['verified'] else 'DIFFER'}")
            else:
                self.tick(f"weights, one reader: full read {d['full read']:.2f} s, row shard "
                          f"{d['row shard']:.2f} s, column shard {d['column shard']:.2f} s")


def run(s: Any, tick: Callable[[str], None]) -> dict[str, Any]:
    n, k, mb = s.weights_readers, s.weights_servers, s.weights_mb
    nbytes = mb << 20
    out: dict[str, Any] = {"readers": n, "servers": k, "mb": mb, "bytes": nbytes, "versions": VERSIONS,
                           "rounds": s.weights_rounds, "warmup": s.weights_warmup, "cap_mbit": s.cap_mbit}
    link = s.cap_mbit / 8 * 1e6 if s.cap_mbit else 0.0
    # the readers start once the version is complete: the trainer's link carries it once,
    # then the servers' links carry it to every reader
    out["link_bound_seconds"] = {"publish_to_all_hold": (nbytes + n * nbytes / min(k, n)) / link if link else None,
                                 "full_read": nbytes / link if link else None}
    capacity = f"{VERSIONS * mb // k + 128}M"
    with Testbed(k, n + 1, cap_mbit=s.cap_mbit, log_level=s.log_level, capacity=capacity) as tb:
        sig = tb.workdir / "weights"
        sig.mkdir(exist_ok=True)
        specs = [{"mode": "weights", "rank": r, "world": n + 1, "mb": mb, "rounds": s.weights_rounds,
                  "warmup": s.weights_warmup, "name": "bench/weights", "servers": k, "versions": VERSIONS,
                  "master": tb.workers[0].address, "master_port": MASTER_PORT, "signal_dir": str(sig),
                  "log_level": s.log_level} for r in range(n + 1)]
        out["hosts"] = {"trainer": tb.workers[0].role, "readers": [h.role for h in tb.workers[1:]],
                        "servers": [h.role for h in tb.servers]}
        runs = tb.run_workers(specs, name="weights-", timeout=s.weights_timeout,
                              watch=_Progress(sig / "progress.jsonl", tick, n))
    figures = runs[0]["figures"]
    counted = figures[s.weights_warmup:]
    out["rounds_seen"] = figures
    out["publish_to_all_hold_s"] = statistics.median(f["publish_to_all_hold"] for f in counted)
    out["publish_acked_s"] = statistics.median(f["publish_acked"] for f in counted)
    out["broadcast_s"] = statistics.median(f["broadcast"] for f in counted)
    out["verified"] = all(f["verified"] for f in figures)
    out["shards_s"] = runs[1]["shards"]
    return out


# -- report -------------------------------------------------------------------------
def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def rows(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """(measure, seconds, against, seconds) of the table."""
    s = r["shards_s"]
    return [(f"publish -> all {r['readers']} readers hold", r["publish_to_all_hold_s"],
             "gloo broadcast to the same readers", r["broadcast_s"]),
            ("row shard (2-way), one reader", s["row shard"], "its full read", s["full read"]),
            ("column shard (2-way), one reader", s["column shard"], "its full read", s["full read"])]


def table(r: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    lines = ["| measure | seconds | against | seconds | ratio |", "| --- | ---: | --- | ---: | ---: |"]
    for a, ta, b, tb in rows(r):
        lines.append(f"| {a} | {ta:.3f} | {b} | {tb:.3f} | {_ratio(ta, tb):.2f} |")
    return "\n".join(lines) + "\n"


def summary(r: dict[str, Any]) -> str:
    b = r["link_bound_seconds"]
    bound = "" if b["full_read"] is None else (
        f"; link bounds: publish -> all hold {b['publish_to_all_hold']:.2f} s, a full read {b['full_read']:.2f} s")
    return (f"**Weights**: {r['bytes'] / 1e6:.0f} MB of float32 ({r['mb']} MiB), a trainer and {r['readers']} "
            f"readers on worker hosts, {r['servers']} memory servers on hosts of their own, {r['versions']} "
            f"versions kept; median of {r['rounds']} rounds after {r['warmup']}; publish acknowledged after "
            f"{r['publish_acked_s']:.2f} s; every reader's checksums "
            f"{'matched' if r['verified'] else 'DID NOT match'}{bound}\n")


def targets(r: dict[str, Any]) -> list[str]:
    speedup = _ratio(r["broadcast_s"], r["publish_to_all_hold_s"])
    shard = _ratio(r["shards_s"]["row shard"], r["shards_s"]["full read"])
    return [f"weights: publish -> all hold {speedup:.2f}x faster than the gloo broadcast (target "
            f"{BROADCAST_TARGET:g}x): {'met' if speedup >= BROADCAST_TARGET else 'NOT met'}; row shard "
            f"{shard:.2f} of the full read (target at most {SHARD_TARGET}): "
            f"{'met' if shard <= SHARD_TARGET else 'NOT met'}; checksums: {'match' if r['verified'] else 'DIFFER'}"]
