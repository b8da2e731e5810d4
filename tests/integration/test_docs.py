"""Every fenced ```python and ```sh block of README.md and docs/*.md runs as written
against a real local cluster (``SMB_CONTROLLER``/``SMB_TOKEN`` in the environment, the
repository as working directory).

A block that cannot run in a test (it starts a cluster of its own, trains for
minutes, or is a fragment of a larger program) is preceded by a line
``<!-- not-run: REASON -->``; it is reported as skipped with that reason.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from smb_client import Client

ROOT = Path(__file__).resolve().parents[2]
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
    env = dict(os.environ, SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
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
        out = subprocess.run([sys.executable, "-m", "smb_server.cli", "region", "ls", "cli/"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()
        assert header.split() == ["NAME", "SIZE", "PLACEMENT", "STATE", "SERVERS"]
        assert row.split()[:3] == ["cli/ls", "3.0", "MiB"]
    finally:
        with Client(cluster.address, cluster.token) as c:
            c.delete_region("cli/ls")
