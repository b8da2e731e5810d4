"""`smb train`: the digits example, every scheme under torchrun against a running cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")



def test_smb_train_runs_every_scheme_under_torchrun(cluster, tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    proc = subprocess.run(
        [sys.executable, "-m", "smb_server.commands.cli", "train", "--scheme", "all", "--workers", "2",
         "--epochs", "3", "--quiet", "--", "--json", str(out), "--job", f"cli{os.getpid()}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"sync", "seasgd", "hybrid"}
    for row in rows.values():
        assert row["workers"] == 2
        assert row["samples"] > 0 and row["bytes_moved"] > 0
        assert row["accuracy"] > 0.3, row           # chance is 0.1
    assert rows["sync"]["steps"] == [66, 66]        # 1437 samples // 64 per step = 22, × 3 epochs
    assert "scheme" in proc.stdout and "samples/s" in proc.stdout
    # the example cleaned up after itself
    with cluster.client() as c:
        assert c.list_regions(f"cli{os.getpid()}") == []


def test_the_module_launcher_runs_its_workers(cluster, tmp_path):
    """``python -m smb_train.digits --workers N``: torchrun gets the module's import
    name, not ``__main__`` (which its workers cannot import)."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    proc = subprocess.run(
        [sys.executable, "-m", "smb_train.digits", "--controller", cluster.address,
         "--scheme", "seasgd", "--workers", "2", "--epochs", "1", "--quiet", "--json", str(out),
         "--job", f"mod{os.getpid()}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["scheme"] for r in json.loads(out.read_text())] == ["seasgd"]


def test_smb_train_needs_no_source_checkout(tmp_path):
    """The trainer is part of the package: the command finds it from any directory, with
    no examples/ beside it."""
    proc = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "train", "--", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--min-accuracy" in proc.stdout and "sync" in proc.stdout


def test_smb_train_refuses_or_replaces_regions_a_crashed_run_left(cluster, tmp_path):
    """Regions left under the job's namespace (a killed run) make `smb train` stop at once
    with a message naming --replace; with --replace they are deleted and the run goes on."""
    job = f"stale{os.getpid()}"
    with cluster.client() as c:
        c.create_region(f"{job}/sync/params", 1 << 20, placement="single").close()
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    argv = [sys.executable, "-m", "smb_server.commands.cli", "train", "--scheme", "sync", "--workers", "2",
            "--epochs", "1", "--quiet"]
    refused = subprocess.run(argv + ["--", "--job", job], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "--replace" in refused.stderr and f"{job}/sync/params" in refused.stderr, refused.stderr
    with cluster.client() as c:
        assert [r.name for r in c.list_regions(f"{job}/")] == [f"{job}/sync/params"]   # untouched

    replaced = subprocess.run(argv + ["--replace", "--", "--job", job], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)
    assert replaced.returncode == 0, replaced.stdout[-3000:] + replaced.stderr[-3000:]
    assert f"deleting 1 region(s) left under {job}/" in replaced.stdout
    with cluster.client() as c:
        assert c.list_regions(f"{job}/") == []
