"""A SEASGD job under ``torchrun --max-restarts``: a worker killed with SIGKILL in the
middle of training; torchrun starts the group again, which resumes from the global
weights and the counters in the memory box, and the job finishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from smb_protocol.errors import RegionNotFound
from smb_server.testing import wait_until

pytest.importorskip("torch")
pytest.importorskip("sklearn")

COUNTER_WORDS = 8   # the counters region's fixed words; worker r's count is word 8 + r


def _workers(agent: int) -> dict[tuple[int, int], int]:
    """(rank, restart count) -> pid of the torchrun workers whose parent is ``agent``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            found[(int(env["RANK"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))] = int(entry.name)
    return found


def _wait_for_steps(client, name: str, rank: int, steps: int, proc: subprocess.Popen, timeout: float) -> int:
    regions = []

    def count() -> int | None:
        assert proc.poll() is None, "the job ended before the kill"
        try:
            regions[:] = regions or [client.open_region(name, mode="ro")]
            done = int(np.asarray(regions[0].read((COUNTER_WORDS + rank) * 8, 8, dtype="int64"))[0])
        except RegionNotFound:
            return None
        return done if done >= steps else None
    return wait_until(count, f"rank {rank} to reach {steps} steps", timeout, pause=0.01)


@pytest.mark.timeout(400)
def test_a_killed_seasgd_worker_is_restarted_and_resumes_from_the_memory_box(cluster, tmp_path):
    job = f"restart{os.getpid()}"
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", "-m", "smb_train.digits", "--scheme", "seasgd", "--job", job,
           "--epochs", "40", "--quiet", "--result-dir", str(out)]   # long enough to be killed mid-way
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        with cluster.client() as c:
            # both ranks made steps before the kill (SEASGD's ranks run apart: rank 1 can
            # reach 40 while rank 0, which created the store, has made none)
            _wait_for_steps(c, f"{job}/seasgd/counters", 0, 10, proc, timeout=180)
            before = _wait_for_steps(c, f"{job}/seasgd/counters", 1, 40, proc, timeout=180)
            victim = _workers(proc.pid)[(1, 0)]
            os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "torchrun.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "torchrun.log").read_text()
    assert "RegionExists" not in text
    results = [json.loads((out / f"seasgd-rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["restarts"] == 1                      # written by the restarted group
        # the counts in the box went on from the first attempt's
        assert r["steps"] > r["local_steps"], (r["rank"], r["restarts"], r["steps"], r["local_steps"], results)
    assert results[1]["steps"] >= before
    assert results[0]["accuracy"] > 0.5, results[0]   # chance is 0.1
    with cluster.client() as c:
        assert c.list_regions(f"{job}/") == []          # the finished job cleaned up
