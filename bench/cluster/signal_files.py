"""The JSON files an experiment and its workers signal each other with (in a run's
``signal_dir``: ``kill.json``, ``joined.json``, ``stop.json``, ...)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` whole: a reader sees no file or all of it (a temporary
    file beside it, then a rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any] | None:
    """The document at ``path``; None while there is none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
