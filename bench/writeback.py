"""Write-back and adoption of file-backed extents against plain file I/O measured in the
same run.

    .venv/bin/python bench/writeback.py              # 64 and 256 MiB extents
    .venv/bin/python bench/writeback.py --quick      # 64 MiB only
    .venv/bin/python bench/writeback.py --dir /data  # on another file system

A file-backed extent lives in a memfd and the memory server copies it into its file
every ``WRITEBACK_SECONDS`` and when it stops (``Extent.write_back``: the parts holding
data, then ``fdatasync``), and copies the file into a new memfd when a restarted server
adopts it. Measured, for an extent whose every page holds data and for one with one
page in a hundred written:

* ``write-back``: :meth:`Arena.write_back` of the extent;
* ``reference write``: ``pwrite`` of the same number of bytes from a buffer into a
  file of the same directory, contiguous and in place as the write-back is (the file
  exists after the first round), then ``fdatasync`` (what any copy to disk costs);
* ``adopt``: a new :class:`Arena` on the directory (reads the file into a memfd);
* ``reference read``: ``preadv`` of the whole file into a buffer (page cache warm in
  both).

Ratios are reference time over our time (above 1: faster than the reference). Results go
to ``bench/results/writeback.json`` and a Markdown table in ``bench/results/writeback.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from smb_server.memserver.arena import HEADER_BYTES, Arena  # noqa: E402

MiB = 1 << 20
PAGE = 4096
ROUNDS = 3


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def reference_write(path: str, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)   # in place after the first round
    try:
        view = memoryview(buf).cast("B")
        pos = 0
        while pos < len(view):
            pos += os.pwrite(fd, view[pos:pos + (64 << 20)], pos)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def reference_read(path: str, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(buf).cast("B")
        pos = 0
        while pos < len(view):
            pos += os.preadv(fd, [view[pos:pos + (64 << 20)]], pos)
    finally:
        os.close(fd)


def measure(base: str, size: int, every: int) -> dict[str, Any]:
    """One extent of ``size`` bytes with one page in ``every`` written."""
    data_dir = os.path.join(base, "data")
    arena = Arena(2 * size, data_dir, writeback_seconds=0)
    extent = arena.reserve(1, "bench", size, persistent=True)
    pages = np.frombuffer(extent.data, np.uint8).reshape(-1, PAGE)
    pages[::every, :8] = 7
    del pages
    written = (size // PAGE + every - 1) // every * PAGE
    ours = [timed(arena.write_back) for _ in range(ROUNDS)]
    buf = np.full(written, 7, np.uint8)
    ref_path = os.path.join(base, "reference")
    ref = [timed(lambda: reference_write(ref_path, buf)) for _ in range(ROUNDS)]
    arena.close()
    adopt = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        again = Arena(2 * size, data_dir, writeback_seconds=0)
        adopt.append(time.perf_counter() - start)
        again.close()
    whole = np.empty(HEADER_BYTES + size, np.uint8)
    file_path = os.path.join(data_dir, "1.extent")
    read = [timed(lambda: reference_read(file_path, whole)) for _ in range(ROUNDS)]
    shutil.rmtree(data_dir)
    os.unlink(ref_path)
    w, r, a, rr = (statistics.median(x) for x in (ours, ref, adopt, read))
    return {"extent_bytes": size, "data_bytes": written, "pages_written": f"1 in {every}",
            "write_back_s": w, "reference_write_s": r, "write_ratio": r / w,
            "adopt_s": a, "reference_read_s": rr, "read_ratio": rr / a,
            "write_back_MiBps": written / w / MiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB only")
    ap.add_argument("--dir", default="/var/tmp", help="where the files go (a disk, not tmpfs)")
    args = ap.parse_args()
    sizes = [64 * MiB] if args.quick else [64 * MiB, 256 * MiB]
    base = tempfile.mkdtemp(prefix="smb-writeback-", dir=args.dir)
    rows = []
    try:
        for size in sizes:
            for every in (1, 100):
                rows.append(measure(base, size, every))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    lines = ["| extent | pages with data | write-back | reference write | ratio | adopt | reference read | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['extent_bytes'] // MiB} MiB | {row['pages_written']} | "
                     f"{row['write_back_s'] * 1e3:.0f} ms | {row['reference_write_s'] * 1e3:.0f} ms | "
                     f"{row['write_ratio']:.2f} | {row['adopt_s'] * 1e3:.0f} ms | "
                     f"{row['reference_read_s'] * 1e3:.0f} ms | {row['read_ratio']:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "dir": args.dir, "rounds": ROUNDS}
    with open(os.path.join(out, "writeback.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(out, "writeback.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
