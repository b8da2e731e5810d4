"""Fixtures of the integration tests (the local-cluster fixtures shared with the rdma
tier are in tests/conftest.py)."""
from __future__ import annotations

import os

import pytest

from tests.integration.daemons import Daemon, free_port


@pytest.fixture
def cluster_env(tmp_path):
    """A controller with a metrics endpoint (lease 60 s: a server marked down quickly
    was told so, not timed out); yields (env, controller Daemon, metrics port)."""
    secret = tmp_path / "secret"
    secret.write_text("5a" * 32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(SMB_TOKEN="op-token", SMB_SECRET_FILE=str(secret))
    metrics = free_port()
    ctl = Daemon(tmp_path, "controller", ["controller", "--listen", "127.0.0.1:0", "--db",
                                          str(tmp_path / "c.db"), "--lease", "60",
                                          "--metrics-port", str(metrics)], env)
    env["SMB_CONTROLLER"] = ctl.wait_ready()["address"]
    daemons = [ctl]
    yield env, daemons, metrics
    for d in reversed(daemons):
        d.stop()
