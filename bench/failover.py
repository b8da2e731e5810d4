"""The kill-the-leader experiment: three controllers on one etcd, two memory servers, a
stream of region creates and deletes and a data-plane workload running, and the leader
killed (SIGKILL) again and again.

    .venv/bin/python bench/failover.py               # 10 kills, default leader lease (5 s)
    .venv/bin/python bench/failover.py --kills 3     # shorter

After each kill the dead controller is started again (it comes back as a standby), so
that two controllers always stand by. At the end the region table is compared with what
was acknowledged:

* ``lost``: regions whose create was acknowledged, never deleted, and that are missing;
* ``resurrected``: regions whose delete was acknowledged and that exist again;
* creates and deletes that raised are not acknowledged (their outcome is unknown to the
  caller) and are counted apart;
* ``longest unavailability``: the longest time between two acknowledged control calls
  (the stream makes one every few milliseconds while the control plane works);
* ``data-plane errors``: failed writes or reads, or a read that did not return what was
  written, on a region opened before the first kill (the data plane never needs the
  controller).

Results go to ``bench/results/failover.json`` and ``bench/results/failover.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from smb_protocol import errors  # noqa: E402
from smb_server.testing import ControllerGroup, EtcdServer  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
SETTLE = 2.0  # seconds of normal operation between a takeover and the next kill


class Stream(threading.Thread):
    """Creates and deletes regions through a client given every controller."""

    def __init__(self, group: ControllerGroup, stop: threading.Event) -> None:
        super().__init__(name="control-stream", daemon=True)
        self.group, self.stop = group, stop
        self.alive: set[str] = set()       # acknowledged creates not deleted
        self.deleted: set[str] = set()     # acknowledged deletes
        self.unknown: set[str] = set()     # a create or delete that raised
        self.acks: list[float] = []        # monotonic time of each acknowledged call
        self.failures: list[str] = []

    def run(self) -> None:
        rng = random.Random(7)
        n = 0
        with self.group.client(reconnect_timeout=60) as c:
            while not self.stop.is_set():
                if self.alive and rng.random() < 0.45:
                    name = rng.choice(sorted(self.alive))
                    self.alive.discard(name)
                    try:
                        c.delete_region(name)
                        self.deleted.add(name)
                    except errors.SMBError as exc:
                        self.unknown.add(name)
                        self.failures.append(f"delete {name}: {type(exc).__name__}: {exc}")
                        continue
                else:
                    name = f"stream/r{n}"
                    n += 1
                    try:
                        c.create_region(name, 64 * KiB, placement="single")
                        self.alive.add(name)
                    except errors.SMBError as exc:
                        self.unknown.add(name)
                        self.failures.append(f"create {name}: {type(exc).__name__}: {exc}")
                        continue
                self.acks.append(time.monotonic())


class DataPlane(threading.Thread):
    """Writes and reads back a region opened before the first kill."""

    def __init__(self, group: ControllerGroup, stop: threading.Event) -> None:
        super().__init__(name="data-plane", daemon=True)
        self.group, self.stop = group, stop
        self.ops = 0
        self.errors: list[str] = []
        self.ready = threading.Event()

    def run(self) -> None:
        with self.group.client(reconnect_timeout=60) as c:
            region = c.create_region("data/weights", 4 * MiB)
            self.ready.set()
            k = 0
            while not self.stop.is_set():
                payload = (k % 251).to_bytes(1, "little") * (256 * KiB)
                offset = (k * 256 * KiB) % (4 * MiB)
                try:
                    region.write(offset, payload)
                    if bytes(region.read(offset, len(payload))) != payload:
                        self.errors.append(f"op {k}: read back other bytes")
                except errors.SMBError as exc:
                    self.errors.append(f"op {k}: {type(exc).__name__}: {exc}")
                self.ops += 2
                k += 1


def run(kills: int, lease: int, workdir: Path) -> dict[str, Any]:
    etcd = EtcdServer()
    group = ControllerGroup(workdir, etcd.url("bench"), count=3, leader_lease=lease)
    stop = threading.Event()
    takeovers: list[float] = []
    try:
        group.start()
        group.wait_leader()
        group.start_server()
        group.start_server()
        data = DataPlane(group, stop)
        data.start()
        data.ready.wait(60)
        stream = Stream(group, stop)
        stream.start()
        time.sleep(SETTLE)
        for k in range(kills):
            leader = group.wait_leader()
            killed = time.monotonic()
            group.kill(leader)
            others = tuple(i for i in range(3) if i != leader)
            new = group.wait_leader(timeout=60, among=others)
            takeovers.append(time.monotonic() - killed)
            print(f"kill {k + 1}/{kills}: controller {leader} killed, controller {new} leads "
                  f"after {takeovers[-1]:.2f} s", flush=True)
            group.start_controller(leader)  # back as a standby
            time.sleep(SETTLE)
        stop.set()
        stream.join(120)
        data.join(120)
        with group.client(reconnect_timeout=30) as c:
            present = {r.name for r in c.list_regions("stream/")}
    finally:
        stop.set()
        group.stop()
        etcd.stop()
    gaps = [b - a for a, b in zip(stream.acks, stream.acks[1:], strict=False)]
    return {
        "kills": kills, "leader_lease_seconds": lease, "controllers": 3, "memory_servers": 2,
        "acknowledged_creates": len(stream.alive) + len(stream.deleted),
        "acknowledged_deletes": len(stream.deleted),
        "not_acknowledged": len(stream.unknown),
        "lost": sorted(stream.alive - present),
        "resurrected": sorted(stream.deleted & present),
        "longest_unavailability_seconds": round(max(gaps, default=0.0), 3),
        "takeover_seconds": [round(t, 3) for t in takeovers],
        "data_plane_ops": data.ops, "data_plane_errors": data.errors[:20],
        "control_failures": stream.failures[:20],
        "machine": f"{platform.node()} ({os.cpu_count()} cpus)",
    }


def markdown(r: dict[str, Any]) -> str:
    takeovers = r["takeover_seconds"]
    rows = [
        ("leader kills (SIGKILL)", r["kills"]),
        ("leader lease", f"{r['leader_lease_seconds']} s"),
        ("acknowledged creates / deletes", f"{r['acknowledged_creates']} / {r['acknowledged_deletes']}"),
        ("acknowledged operations lost", len(r["lost"])),
        ("deleted regions resurrected", len(r["resurrected"])),
        ("calls that raised (outcome unknown to the caller)", r["not_acknowledged"]),
        ("longest unavailability of the control plane", f"{r['longest_unavailability_seconds']:.2f} s"),
        ("kill to new leader serving: median / max",
         f"{sorted(takeovers)[len(takeovers) // 2]:.2f} s / {max(takeovers):.2f} s" if takeovers else "-"),
        ("data-plane operations / errors", f"{r['data_plane_ops']} / {len(r['data_plane_errors'])}"),
        ("load average (1 min) before / after the run",
         " / ".join(map(str, r["load_average"])) if "load_average" in r else "-"),
    ]
    return "\n".join(["| measure | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--lease", type=int, default=5, help="leader lease, whole seconds (default 5)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="smb-failover-") as tmp:
        result = run(args.kills, args.lease, Path(tmp))
    # the machine may be shared: its 1-minute load average before and after the run
    result["load_average"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "failover.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(os.path.join(args.out, "failover.md"), "w") as f:
        f.write(table)
    print(table)
    bad = result["lost"] or result["resurrected"] or result["data_plane_errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
