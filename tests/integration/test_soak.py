"""Sixty seconds of the soak (bench/soak.py): etcd, two controllers, three memory
servers, the mixed load, one memory server killed and restarted and the leader killed;
every invariant must hold. The soak waits on the cluster's state (ready files, the
leader key, region states), not on fixed sleeps; its fault schedule is fixed (20 s and
40 s), and each fault waits until the cluster is healthy again, so a loaded machine makes
it slower, not different."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import soak

OPERATIONS = ("write", "read", "accumulate", "fetch_add", "compare_swap", "create", "delete", "all_reduce")


@pytest.mark.timeout(420)
def test_soak_one_minute(tmp_path: Path) -> None:
    plot = tmp_path / "soak.png"
    result = soak.run(1.0, tmp_path / "cluster", plot=str(plot), json_path=str(tmp_path / "soak.json"))
    assert result["ok"], "invariants violated:\n" + "\n".join(result["violations"])
    assert sorted(f["kind"] for f in result["faults"]) == ["leader", "server"], result["faults"]
    assert all(f["recovered"] is not None for f in result["faults"]), result["faults"]
    for op in OPERATIONS:
        assert result["ops"].get(op, 0) > 0, f"no {op} was acknowledged: {result['ops']}"
    assert result["stale_handle_checks"] > 0
    assert result["shared_counters"]["acked"] > 0
    assert result["bytes_checked_at_end"] > 0
    assert any(v.get("judged") for v in result["flatness"]), result["flatness"]
    assert plot.stat().st_size > 0
