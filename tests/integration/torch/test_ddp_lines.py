"""docs/training.md shows one DDP script three ways (gloo, the smb backend,
SyncDataParallel); the docs test runs each under torchrun, and this test counts how
many lines the two memory-box versions change: at most 3 (2 as written)."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"
SECTION = "## From DDP: the same script three ways"
HEREDOC = re.compile(r"cat > \"\$script\" <<'PY'\n(.*?)\nPY\n", re.S)


def scripts() -> list[list[str]]:
    text = DOC.read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start + len(SECTION))]
    return [m.group(1).splitlines() for m in HEREDOC.finditer(section)]


def changes(old: list[str], new: list[str]) -> tuple[int, int, int]:
    """(lines touched, lines added, lines removed): a replaced line counts once as touched."""
    touched = added = removed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if op != "equal":
            touched += max(i2 - i1, j2 - j1)
            added += j2 - j1
            removed += i2 - i1
    return touched, added, removed


def test_three_scripts_are_shown():
    ddp, backend, sync = scripts()
    assert "torch.nn.parallel.DistributedDataParallel(model)" in "\n".join(ddp)
    assert 'dist.init_process_group("smb")' in backend
    assert "ddp = smb_client.torch.DistributedDataParallel(model)" in sync


def test_either_path_changes_at_most_three_lines_of_the_ddp_script():
    ddp, backend, sync = scripts()
    for name, script in (("backend", backend), ("SyncDataParallel", sync)):
        touched, added, removed = changes(ddp, script)
        assert touched <= 3 and added + removed <= 3, (name, touched, added, removed)
        assert touched == 2, (name, touched)                     # the import and one line
    loop = [i for i, line in enumerate(ddp) if line.startswith("for step")][0]
    assert ddp[loop:] == backend[loop + 1:] == sync[loop + 1:]   # the loop untouched


def test_changes_counts_inserts_and_replacements():
    assert changes(["a", "b", "c"], ["a", "x", "b", "y"]) == (2, 2, 1)
