"""The Ansible playbook (deploy/ansible/site.yml) run for real against this machine with
a local connection; shared by the playbook's tests."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE = ROOT / "deploy" / "ansible"
VENV_BIN = Path(sys.executable).parent
PLAYBOOK_TIMEOUT = 300   # seconds


def playbook_marks(needs_root_for: str) -> list[pytest.MarkDecorator]:
    """The marks of a module that runs the playbook: slow, and skipped without
    ansible-core, root (the playbook ``needs_root_for`` something) or apt."""
    return [
        pytest.mark.slow,
        pytest.mark.skipif(not (VENV_BIN / "ansible-playbook").exists(),
                           reason="ansible-core is not installed (the dev extra pins it: make deps)"),
        pytest.mark.skipif(os.geteuid() != 0, reason=f"the playbook {needs_root_for}: needs root"),
        pytest.mark.skipif(shutil.which("apt-get") is None, reason="the playbook targets Debian (apt)"),
    ]


def run_playbook(workdir: Path, variables: dict[str, Any]) -> str:
    """Run site.yml on localhost with ``variables`` (written to ``workdir``/vars.json),
    in ``workdir``; asserts that it succeeded and returns its output."""
    (workdir / "vars.json").write_text(json.dumps(variables))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"), ANSIBLE_PIPELINING="1",
               ANSIBLE_LOCAL_TEMP=str(workdir / "ansible-tmp"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    out = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-c", "local", "-i", "localhost,",
                          str(ANSIBLE / "site.yml"), "-e", f"@{workdir / 'vars.json'}"],
                         capture_output=True, text=True, timeout=PLAYBOOK_TIMEOUT, env=env, cwd=workdir)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    return out.stdout


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of an environment file the playbook wrote, read as systemd's
    EnvironmentFile= reads them (comments and blank lines skipped, double quotes taken off)."""
    pairs = [line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return {k: v.strip('"') for k, v in pairs}
