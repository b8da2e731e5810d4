"""``smb_client.torch.DistributedDataParallel`` under a real ``torchrun --max-restarts 1``:
a worker killed with SIGKILL mid-run; torchrun starts the group again, the wrapper
starts afresh (rank 0 replaces the dead attempt's store, every worker begins from rank
0's model, ``ddp.job.resumed`` is None), and both ranks finish the loop with the same
weights."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from smb_server.testing import wait_until
from tests.integration.torch.test_torch_restart import _workers

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("ddp_restart_worker.py")


def _step(out: Path, rank: int, restart: int) -> int | None:
    try:
        return int((out / f"progress-{rank}-{restart}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.timeout(400)
def test_a_killed_ddp_wrapper_worker_is_restarted_and_starts_afresh(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, DDP_TEST_STEPS="500",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH"))
                                          if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", str(WORKER), str(out)]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        def far_enough() -> bool:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-4000:]
            step = _step(out, 1, 0)
            return step is not None and step >= 20
        wait_until(far_enough, "rank 1 to make 20 steps", 180, pause=0.01)
        os.kill(_workers(proc.pid)[(1, 0)], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "torchrun.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["restart"] == 1, r                      # written by the restarted group
        assert r["resumed"] is None, r                   # started afresh, and says so
        assert r["started_from_the_seed"], r             # from rank 0's model, not mid-run weights
    assert results[0]["weights_sum"] == results[1]["weights_sum"]
