"""The failure experiment's summary (bench/cluster/replica_failure.py) from what the
monitor and the controller's log recorded: a repair that falls between two looks at the
regions' states is still measured, from the controller's log and the monitor's look at
the copies, not reported as never repaired."""
from __future__ import annotations

import datetime

from bench.cluster import replica_failure

KILL = 1_800_000_000.0


def _line(t: float, text: str) -> str:
    stamp = datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} WARNING smb_server.controller.repair: {text}"


def _run(monitor: dict, log: list[str]) -> dict:
    killed = {"time": KILL, "server": "s1", "role": "srv1", "address": "198.18.0.11"}
    worker = {"rank": 0, "accuracy": 0.9, "time": 30.0, "local_steps": 10, "step_log": [],
              "smallest_delta": 0.01}
    return {"undisturbed": {"error": None, "workers": [worker]},
            "kill": {"error": None, "workers": [worker], "killed": killed, "monitor": monitor,
                     "check": {}},
            "controller_log": log}


def test_a_repair_between_two_looks_at_the_states_is_measured():
    ready = {"params": "ready", "counters": "ready"}
    monitor = {"states": [[KILL - 10, ready]],          # never saw `degraded`
               "servers": [[KILL - 10, {"s1": "up"}], [KILL + 5.2, {"s1": "down"}]],
               "repaired_at": KILL + 5.3}
    log = [_line(KILL + 0.03, "region job/params slot 1: the primary on server s2 cannot reach copy 1 "
                 "on server s1 (reset); the copy is dropped from the replica set (view 3)"),
           _line(KILL + 0.05, "region job/params slot 1: bringing copy 2 (extent 7) on server s3 in step "
                 "from the primary on s2 (spare, view 4, 2000000 bytes)"),
           _line(KILL + 0.25, "region job/params slot 1: copy 2 on server s3 in step (2000000 bytes copied "
                 "in 0.200 s, 10 MB/s); 2 of 2 copies"),
           _line(KILL + 5.1, "region job/counters slot 0: copy 1 on server s3 is the primary now (view 4)"),
           _line(KILL + 5.15, "region job/counters slot 0: bringing copy 2 (extent 9) on server s2 in step "
                 "from the primary on s3 (spare, view 5, 1000000 bytes)"),
           _line(KILL + 5.25, "region job/counters slot 0: copy 2 on server s2 in step (1000000 bytes copied "
                 "in 0.050 s, 20 MB/s); 2 of 2 copies")]
    failure = replica_failure.summarize(_run(monitor, log))["failure"]
    assert abs(failure["degraded_after"] - 0.03) < 0.01
    assert abs(failure["promoted_after"] - 5.1) < 0.01 and failure["promotions"] == 1
    assert abs(failure["ready_after"] - 5.3) < 1e-6
    assert abs(failure["degraded_seconds"] - 5.27) < 0.01
    assert abs(failure["marked_down_after"] - 5.2) < 1e-6
    repair = failure["repair"]
    assert repair["bytes"] == 3_000_000 and repair["copies"] == 2
    assert abs(repair["copy_seconds"] - 0.25) < 1e-9           # the copies' own times
    assert abs(repair["MBps"] - 12.0) < 1e-6                   # 3 MB in 0.25 s of copying
    assert abs(repair["seconds"] - 5.2) < 0.01                 # first sync start to last in step


def test_no_repair_seen_is_reported_as_none():
    monitor = {"states": [[KILL - 10, {"params": "ready"}], [KILL + 1, {"params": "degraded"}]],
               "servers": []}
    failure = replica_failure.summarize(_run(monitor, []))["failure"]
    assert failure["degraded_after"] == 1
    assert failure["ready_after"] is None and failure["degraded_seconds"] is None
