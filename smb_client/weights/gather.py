"""Reading scattered pieces of a region in few requests, and converting types on the way.

:func:`read_pieces` fills many ``(region offset, buffer)`` pieces (the rows of a column
shard, say): pieces closer than :data:`~.shards.SKIP_GAP` share one range, read as whole
requests (at most the client's ``chunk_bytes`` each) whose bytes land straight in the
pieces' buffers, the gaps' bytes in a small scratch buffer. Requests go through the
region's route (ticket, failover, replicas), all servers in parallel.

:func:`convert` changes a float type chunk by chunk (bfloat16 through its bit patterns).
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from smb_protocol.dtypes import FLOATING, STORAGE, DType, bf16_to_f32, f32_to_bf16
from smb_protocol.errors import DtypeError
from smb_protocol.placement import Run

from ..region import Region
from .shards import SKIP_GAP, spans

log = logging.getLogger(__name__)


def read_pieces(region: Region, pieces: Sequence[tuple[int, memoryview]], skip_gap: int = SKIP_GAP) -> int:
    """Fill every ``(offset, view)`` piece (``view``: writable bytes) from ``offset`` of
    ``region``; returns the number of requests sent."""
    groups = spans([(off, len(view)) for off, view in pieces], skip_gap)
    gap = max((b[0] - (a[0] + a[1]) for g in groups for a, b in zip(g.pieces[:-1], g.pieces[1:], strict=True)),
              default=0)
    scratch = memoryview(bytearray(gap))
    route = region.route
    tasks: list[Callable[[], Any]] = []

    def task(run: Run, bufs: list[memoryview]) -> Callable[[], Any]:
        return lambda: route.request(run.extent, False, lambda s, place: s.read_into(
            route.ticket, place.extent_id, run.extent_offset, bufs))

    for g in groups:
        region.layout.check_range(g.start, g.end - g.start)
        starts: list[int] = []
        views: list[memoryview] = []
        pos = g.start
        for off, n, i in g.pieces:
            if off > pos:
                starts.append(pos)
                views.append(scratch[:off - pos])
            starts.append(off)
            views.append(pieces[i][1])
            pos = off + n
        for run in route.chunks(g.start, g.end - g.start):
            bufs: list[memoryview] = []
            for ro, n in run.parts:
                bufs.extend(_cut(starts, views, ro, n))
            tasks.append(task(run, bufs))
    if tasks:
        route.run_all(tasks)
    return len(tasks)


def _cut(starts: list[int], views: list[memoryview], offset: int, n: int) -> list[memoryview]:
    """The slices of the contiguous ``views`` (starting at ``starts``) that cover ``[offset, offset+n)``."""
    out = []
    k = bisect.bisect_right(starts, offset) - 1
    while n:
        view = views[k]
        s = offset - starts[k]
        take = min(len(view) - s, n)
        out.append(view[s:s + take])
        offset += take
        n -= take
        k += 1
    return out


def check_conversion(src: DType, dst: DType, what: str) -> None:
    """DtypeError unless ``src`` may be read as ``dst`` (the same type, or two float types)."""
    if src != dst and not (src in FLOATING and dst in FLOATING):
        raise DtypeError(f"{what} is published as {src.name.lower()} and cannot be read as "
                         f"{dst.name.lower()}: only float types convert into each other")


def convert(src: np.ndarray, src_dt: DType, dst: np.ndarray, dst_dt: DType) -> None:
    """``dst[:] = src`` from one float type to another (arrays of their storage types,
    bfloat16 as uint16 bit patterns; float to bfloat16 rounds to nearest-even)."""
    if src_dt == dst_dt:
        np.copyto(dst, src)
    elif src_dt == DType.BFLOAT16:
        wide = bf16_to_f32(src)
        np.copyto(dst, wide, casting="unsafe")
    elif dst_dt == DType.BFLOAT16:
        dst[:] = f32_to_bf16(src if src_dt == DType.FLOAT32 else src.astype(np.float32))
    else:
        np.copyto(dst, src, casting="unsafe")


def storage_view(raw: memoryview, dt: DType) -> np.ndarray:
    """The bytes ``raw`` as a writable array of ``dt``'s storage type."""
    return np.frombuffer(raw, dtype=np.uint8).view(STORAGE[dt])
