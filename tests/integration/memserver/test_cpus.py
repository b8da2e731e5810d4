"""A memory server started with ``cpus`` runs every thread on those cores (set before
its first thread starts, so the threads it starts later inherit them) and serves as
usual; a core the host lacks stops it at start with the key named (test_config.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from smb_server.commands.local_cluster import LocalCluster


def allowed_cores(pid: int) -> dict[int, str]:
    """Each thread of ``pid``: the cores it may run on, as /proc lists them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:   # the thread ended meanwhile
            continue
        out[int(task.name)] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                                   if line.startswith("Cpus_allowed_list:"))
    return out


def test_a_server_given_one_core_runs_every_thread_there_and_serves(tmp_path):
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"),
                      env={"SMB_CPUS": "0"}) as c, c.client() as client:
        region = client.create_region("test/pinned", 1 << 20)
        data = np.arange(1 << 18, dtype=np.float32)
        region.write(0, data)            # the data plane's connection threads start now
        region.accumulate(0, data)
        assert np.array_equal(region.read(0, data.nbytes, dtype="float32"), 2 * data)
        threads = allowed_cores(c.server_pid(0))
        assert len(threads) > 3 and set(threads.values()) == {"0"}, threads
