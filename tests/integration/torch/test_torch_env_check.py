"""Rank and world size are checked against torchrun's variables: a 4-process launch
that asks SyncDataParallel for 5 workers fails at once in every process, naming both
numbers, instead of waiting at a barrier until it times out (real processes with the
variables torchrun sets, on a real local cluster)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import ParameterStore  # noqa: E402

LAUNCHED = 4

WORKER = textwrap.dedent("""
    import json, sys, time
    import torch
    import smb_client
    from smb_client.torch import ParameterStore, SyncDataParallel, WorkerEnv
    from smb_protocol.errors import InvalidArgument

    address, token, prefix, rank, world = sys.argv[1:6]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with smb_client.connect(address, token) as client:
        store = ParameterStore.attach(client, prefix, model)
        t0 = time.monotonic()
        try:
            SyncDataParallel(store, int(rank), int(world), barrier_timeout=60).close(publish=False)
            out = {"error": None}
        except InvalidArgument as exc:
            out = {"error": str(exc)}
        out["seconds"] = time.monotonic() - t0
        out["env_rank"] = WorkerEnv.from_env().rank
        store.close()
    print(json.dumps(out))
""")


def launch(cluster, name, ranks_and_worlds):
    """One process per (rank, world) asked of SyncDataParallel, with torchrun's variables
    for a launch of LAUNCHED processes; their reports, by launched rank."""
    procs = []
    for launched, (rank, world) in enumerate(ranks_and_worlds):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SMB_", "TORCHELASTIC"))}
        env.update(RANK=str(launched), WORLD_SIZE=str(LAUNCHED), LOCAL_RANK=str(launched),
                   LOCAL_WORLD_SIZE=str(LAUNCHED), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT="29500")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, cluster.address, cluster.token, name, str(rank), str(world)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=50)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return reports


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_world_size_torchrun_did_not_start_fails_at_once(cluster, client, name):
    store = ParameterStore.create(client, name, model(), workers=5)
    try:
        reports = launch(cluster, name, [(r, 5) for r in range(LAUNCHED)])
    finally:
        store.destroy()
    for launched, report in enumerate(reports):
        assert report["env_rank"] == launched
        assert report["error"] is not None, report
        assert "world=5" in report["error"] and "WORLD_SIZE=4" in report["error"], report
        assert report["seconds"] < 5, report                 # not after the barrier timeout


def test_a_rank_other_than_torchruns_fails_at_once(cluster, client, name):
    store = ParameterStore.create(client, name, model(), workers=LAUNCHED)
    try:
        # two of the four processes, each passing the other's rank
        reports = launch(cluster, name, [(1, LAUNCHED), (0, LAUNCHED)])
    finally:
        store.destroy()
    assert "rank=1" in reports[0]["error"] and "RANK=0" in reports[0]["error"], reports[0]
    assert "rank=0" in reports[1]["error"] and "RANK=1" in reports[1]["error"], reports[1]
    assert all(r["seconds"] < 5 for r in reports), reports
