"""`make demo`'s data-plane part: examples/demo.py end to end, small regions."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_demo_runs_and_checks_its_results():
    proc = subprocess.run([sys.executable, "examples/demo.py", "--size", str(4 << 20), "--workers", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for transport in ("tcp", "shm"):
        assert f"[{transport}] master created demo/params" in out
    # every worker verified the data, the gradient sum is exact, the counter saw every worker
    assert out.count("data ok") == 6 and "WRONG" not in out
    assert out.count("every element = 6 (expected 6), exact; iteration counter = 3") == 2
    assert out.rstrip().endswith("demo finished")
