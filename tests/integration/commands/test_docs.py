"""Every fenced ```python and ```sh block of README.md and docs/*.md runs as written
against a real local cluster (``SMB_CONTROLLER``/``SMB_TOKEN`` in the environment, the
repository as working directory).

A block that cannot run in a test (it starts a cluster of its own, trains for
minutes, or is a fragment of a larger program) is preceded by a line
``<!-- not-run: REASON -->``; it is reported as skipped with that reason.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from smb_client import Client, metrics

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str          # "python" or "sh"
    code: str
    not_run: str       # the marker's reason; "" when the block runs

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The runnable fenced blocks of a Markdown file, in order."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = NOT_RUN.match(previous.strip())
        if lang in RUNNABLE:
            out.append(Block(path, start + 1, RUNNABLE[lang], "\n".join(body) + "\n",
                             marker.group(1) if marker else ""))
    return out


ALL = [b for path in DOCS for b in blocks(path)]


def test_the_blocks_are_found():
    readme = [b for b in ALL if b.path.name == "README.md"]
    assert [b.lang for b in readme if not b.not_run] == ["sh", "python"]
    assert {b.path.name for b in ALL} >= {"README.md", "training.md"}


def test_blocks_finds_fences_and_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n<!-- not-run: needs a GPU -->\n```python\nprint(1)\n```\n\n"
                   "```sh\necho hi\n```\n\n```toml\na = 1\n```\n")
    found = blocks(doc)
    assert [(b.line, b.lang, b.code, b.not_run) for b in found] == [
        (4, "python", "print(1)\n", "needs a GPU"), (8, "sh", "echo hi\n", "")]


@pytest.fixture
def env(cluster):
    # a block that dies on a signal prints every thread's Python stack (faulthandler)
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token, PYTHONFAULTHANDLER="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.id)
def test_block_runs_as_written(block, env):
    if block.not_run:
        pytest.skip(f"marked not-run: {block.not_run}")
    if block.lang == "python":
        argv = [sys.executable, "-c", block.code]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{block.id} failed:\n{block.code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_region_ls_prints_readable_sizes(env, cluster):
    with Client(cluster.address, cluster.token) as c:
        c.create_region("cli/ls", 3 * 1024 * 1024).close()
    try:
        out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "region", "ls", "cli/"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()
        assert header.split() == ["NAME", "SIZE", "PLACEMENT", "REPLICAS", "STATE", "SERVERS"]
        assert row.split()[:3] == ["cli/ls", "3.0", "MiB"]
    finally:
        with Client(cluster.address, cluster.token) as c:
            c.delete_region("cli/ls")


def documented_metrics() -> dict[str, str]:
    """Metric name -> type from the tables under "### Metrics" in docs/operations.md
    (``_bytes_written_total`` after ``smb_server_bytes_read_total`` shares its prefix)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`smb_"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        kinds = [k.strip() for k in cells[1].split(",")]
        prefix = "_".join(names[0].split("_")[:2])
        for i, name in enumerate(names):
            out[prefix + name if name.startswith("_") else name] = kinds[min(i, len(kinds) - 1)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_types(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_documented_metrics_are_served(tmp_path):
    """Every metric of the operations guide, with its type, on a real controller, memory
    server and client (and nothing served that the guide leaves out)."""
    secret = tmp_path / "secret"
    secret.write_text("5a" * 32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(SMB_SECRET_FILE=str(secret), SMB_TOKEN="docs-token")
    ports = {"controller": _free_port(), "server": _free_port()}
    procs = []
    try:
        for kind, args in (("controller", ["--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db")]),
                           ("server", ["--state-dir", str(tmp_path / "s"), "--capacity", "16M"])):
            ready = tmp_path / f"{kind}.ready"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "smb_server.commands.cli", kind, *args, "--metrics-port", str(ports[kind]),
                 "--ready-file", str(ready)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 30
            while not ready.exists() or not ready.read_text():
                assert procs[-1].poll() is None and time.monotonic() < deadline, f"{kind} did not start"
                time.sleep(0.05)
            if kind == "controller":
                env["SMB_CONTROLLER"] = json.loads(ready.read_text())["address"]
        served = {**_scrape_types(ports["controller"]), **_scrape_types(ports["server"])}
        client = metrics.serve(0)             # and a client process's own (this one)
        try:
            served.update(_scrape_types(client))
        finally:
            metrics.disable()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    documented = documented_metrics()
    assert len(documented) >= 20
    assert served == documented
