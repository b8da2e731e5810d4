"""The Grafana dashboard in deploy/grafana: every panel's query names a metric that the
daemons (a controller and a memory server, real processes) or a client process export."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from smb_client import metrics
from tests.integration.daemons import free_port, start_server

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "smb.json"
METRIC = re.compile(r"\bsmb_[a-z0-9_]+")
SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total", ""), "summary": ("_count", "_sum", "")}


def exported(port: int) -> set[str]:
    """The sample names a /metrics page can carry, by its families' types (a labelled
    metric with no child yet still declares its family)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {f.name + s for f in text_string_to_metric_families(text) for s in SUFFIXES.get(f.type, ("",))}


def queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def test_the_dashboard_loads_and_each_query_names_an_exported_metric(tmp_path, cluster_env):
    env, daemons, ctl_metrics = cluster_env
    board = json.loads(DASHBOARD.read_text())
    assert board["panels"] and all(p["targets"] for p in board["panels"])
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    server_metrics = free_port()
    server = start_server(tmp_path, env, daemons, "s0", "--capacity", "64M", "--transports", "tcp",
                          "--metrics-port", str(server_metrics))
    server.wait_ready()
    client_metrics = metrics.serve(0)
    try:
        import smb_client
        with smb_client.connect(env["SMB_CONTROLLER"], env["SMB_TOKEN"], transport="tcp") as c:
            r = c.create_region("ops/dashboard", 1 << 20)
            r.accumulate(0, np.ones(1024, np.float32))
            c.delete_region("ops/dashboard")
        known = exported(ctl_metrics) | exported(server_metrics) | exported(client_metrics)
    finally:
        metrics.disable()
    named = {(title, m) for title, expr in queries() for m in METRIC.findall(expr)}
    assert named, "no query names a metric"
    missing = sorted((title, m) for title, m in named if m not in known)
    assert not missing, missing
    # each of the three sources has a panel
    names = {m for _, m in named}
    assert any(m.startswith("smb_controller_") for m in names)
    assert any(m.startswith("smb_server_") for m in names)
    assert any(m.startswith("smb_client_") for m in names)
