"""Real partitions for tests: a scenario runs in a network namespace of its own
(``unshare --net``: the host's loopback and other tests are untouched), where a
policy-routing rule blackholes TCP to one port of its loopback. Every segment sent to
that port is dropped by the kernel (data, acknowledgements, a close's FIN or RST), while
segments from it still arrive: a cut-off peer goes silent, as a host behind a dead
link does.

A test calls :func:`run_in_namespace` with its module and a mode; the module's
``__main__`` block calls the mode's function inside the namespace (after
:func:`lo_up`), which returns JSON-able facts for the test to assert on.

Needs root, util-linux ``unshare`` and iproute2 ``ip rule ... dport``; elsewhere such
tests are skipped with the reason (:func:`unavailable`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def block_rules(port: int) -> list[list[str]]:
    """``ip rule`` commands that blackhole TCP to ``port`` on this namespace's loopback:
    the rule must come before the ``local`` table (priority 0), so that table moves to
    priority 100."""
    return [["ip", "rule", "add", "pref", "10", "ipproto", "tcp", "dport", str(port), "blackhole"],
            ["ip", "rule", "add", "pref", "100", "lookup", "local"],
            ["ip", "rule", "del", "pref", "0"]]


def unblock_rules() -> list[list[str]]:
    return [["ip", "rule", "add", "pref", "0", "lookup", "local"],
            ["ip", "rule", "del", "pref", "100"],
            ["ip", "rule", "del", "pref", "10"]]


def block(port: int) -> None:
    """Cut TCP to ``port`` off (inside the namespace)."""
    for cmd in block_rules(port):
        sh(*cmd)


def unblock() -> None:
    """Let it through again."""
    for cmd in unblock_rules():
        sh(*cmd)


def lo_up() -> None:
    sh("ip", "link", "set", "lo", "up")


def unavailable() -> str | None:
    """Why a private network namespace with a port blackhole cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and policy routing)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    script = " && ".join(["ip link set lo up"] + [" ".join(c) for c in block_rules(9)])
    probe = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot blackhole a port in a network namespace: {probe.stderr.strip()}"
    return None


def run_in_namespace(module: str, mode: str, tmp_path: Path, timeout: float = 220) -> tuple[dict, str]:
    """Run ``python -m module mode WORKDIR FACTS`` in a new network namespace; its facts,
    and a description (the facts and the tail of every log under WORKDIR) for assertion
    messages. Skips the test where no namespace can be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "facts.json"
    workdir = tmp_path / "cluster"
    proc = subprocess.run(["unshare", "--net", "--", sys.executable, "-m", module, mode, str(workdir), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    logs = "".join(f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                   for p in sorted(workdir.rglob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    facts = json.loads(out.read_text())
    return facts, json.dumps(facts, indent=1) + logs
