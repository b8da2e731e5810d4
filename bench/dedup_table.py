"""The exactly-once table alone: the native one (smb_server/memserver/native/dedup.c,
through its Python face :class:`smb_server.memserver.dedup.DedupTable`) against the
pure-Python one it replaced, in the same run.

    git show 82bff0a:smb_server/memserver/dedup.py > /tmp/dedup_old.py   # the Python table
    .venv/bin/python bench/dedup_table.py                    # window 4096, 4 clients
    .venv/bin/python bench/dedup_table.py --old /tmp/dedup_old.py --requests 400000 --repeat 7

(any commit before the port has the Python table, ``82bff0a`` for one; ``--old ''``
measures the native one only.) Each table serves ``--clients`` clients in turn, as a server's planes do:

* ``fresh_us``: a new number's ``begin`` and its ``finish`` (the window full: each
  request also forgets one old entry);
* ``repeat_us``: a repeat's ``begin`` of a finished number still in the window (the
  answer looked up, nothing run).

Printed one JSON line per table: microseconds per operation, the best of ``--repeat``
timings of ``--requests`` requests each.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from smb_server.memserver import dedup  # noqa: E402


def load_old(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("dedup_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure(table_type: Any, window: int, clients: int, requests: int, repeat: int) -> dict[str, float]:
    """Microseconds per fresh begin+finish and per repeat begin; number ``s`` is
    client ``s % clients``'s."""
    what = (4, 100, 0, 64, 3)
    table = table_type(window=window)
    seq = 0

    def fresh(n: int) -> float:
        nonlocal seq
        begin, first = table.begin, seq + 1
        start = time.perf_counter()
        for s in range(first, first + n):
            _, entry = begin(s % clients, s, None, what)
            entry.finish(0, b"")
        seq = first + n - 1
        return time.perf_counter() - start

    fresh(window * clients)   # every window full first: each new number forgets one
    best_fresh = min(fresh(requests) for _ in range(repeat))

    recent = [seq - k for k in range(window * clients // 2)]   # finished, still in their windows
    assert not any(table.begin(s % clients, s, None, what)[0] for s in recent)
    numbers = [recent[i % len(recent)] for i in range(requests)]

    def repeated() -> float:
        begin = table.begin
        start = time.perf_counter()
        for s in numbers:
            begin(s % clients, s, None, what)
        return time.perf_counter() - start

    best_repeat = min(repeated() for _ in range(repeat))
    return {"fresh_us": round(best_fresh / requests * 1e6, 3),
            "repeat_us": round(best_repeat / requests * 1e6, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="/tmp/dedup_old.py", help="the Python table's module ('' to skip)")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tables: list[tuple[str, Any]] = [("native", dedup.DedupTable)]
    if args.old:
        tables.insert(0, ("python", load_old(args.old).DedupTable))
    for name, table_type in tables:
        row = {"table": name, "window": args.window, "clients": args.clients, "requests": args.requests}
        row.update(measure(table_type, args.window, args.clients, args.requests, args.repeat))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
