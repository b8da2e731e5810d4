"""The testbed's CPU sampler (bench/cluster/cpuload.py) split by role: real processes,
one spinning and one asleep, each given a role; the window's cores go to the role of
the process that used them, and the machine's own time is split by kind."""
from __future__ import annotations

import subprocess
import sys
import time

from bench.cluster.cpuload import CpuSampler

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
SLEEP = "import time; time.sleep(30)"


def test_cores_are_split_by_role():
    busy = subprocess.Popen([sys.executable, "-c", SPIN])
    idle = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        with CpuSampler(lambda: {busy.pid: "servers", idle.pid: "workers"}, period=0.05) as cpu:
            t0 = time.time()
            time.sleep(1.0)     # the window measured
            t1 = time.time()
        usage = cpu.usage(t0, t1)
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert usage is not None
    roles = usage["roles"]
    assert roles["servers"] > 0.2                        # one spinning process: up to a core
    assert roles.get("workers", 0.0) < 0.05
    assert abs(usage["cores"] - sum(roles.values())) < 1e-9
    assert set(usage["machine"]) >= {"user", "system", "softirq", "steal"}


def test_without_roles_there_is_no_split():
    with CpuSampler(lambda: [], period=0.05) as cpu:
        t0 = time.time()
        time.sleep(0.3)
        t1 = time.time()
    usage = cpu.usage(t0, t1)
    assert usage is not None and "roles" not in usage and usage["cores"] == 0.0
