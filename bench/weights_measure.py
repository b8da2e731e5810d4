"""What the weights benchmarks share: the state dict they publish, its contents per
version and their checksum, and the timed steps (a broadcast of every tensor, a reader's
full and 2-way shard reads).

Used by ``bench/weights.py`` (one host, a local cluster) and by the testbed's
``weights`` experiment (:mod:`bench.cluster.weights`, :mod:`bench.cluster.weights_worker`).
Times are ``CLOCK_MONOTONIC`` seconds, one clock for every process and network
namespace of the machine; sizes are MB of float32 (``mb << 20`` bytes).
"""
from __future__ import annotations

import logging
import statistics
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

COLS = 4096               # float32 columns of every matrix of the state dict
MAX_ROWS = 1024           # rows of every matrix but the last: 16 MiB each
SHARD_PARTS = 2           # the tensor-parallel shard timed: part 0 of 2


def now() -> float:
    """Seconds on ``CLOCK_MONOTONIC`` (comparable between processes of one machine)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def shapes(mb: int) -> dict[str, tuple[int, int]]:
    """Matrices of COLS float32 columns, 16 MiB each (the last one smaller), ``mb`` MiB in all."""
    rows_total = (mb << 20) // (COLS * 4)
    out, k = {}, 0
    while rows_total > 0:
        rows = min(MAX_ROWS, rows_total)
        out[f"layer{k}.weight"] = (rows, COLS)
        rows_total -= rows
        k += 1
    return out


def state(mb: int, fill: float = 0.0) -> dict[str, np.ndarray]:
    """A state dict of ``mb`` MiB of float32, every element ``fill``."""
    return {k: np.full(s, fill, np.float32) for k, s in shapes(mb).items()}


def base(mb: int) -> dict[str, np.ndarray]:
    """The contents every version starts from: tensor ``i`` random normal from seed ``i``,
    the same in every process."""
    return {k: np.random.default_rng(i).standard_normal(s, dtype=np.float32)
            for i, (k, s) in enumerate(shapes(mb).items())}


def set_version(out: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], version: int) -> None:
    """Make ``out`` hold ``version``'s contents: ``start + version``, element by element
    (every element differs from the same element of any other version)."""
    for k, a in out.items():
        np.add(start[k], np.float32(version), out=a)


def checksum(tensors: Mapping[str, Any]) -> int:
    """CRC-32 of the tensors' bytes, one after the other in the mapping's order (numpy
    arrays or CPU tensors, contiguous)."""
    crc = 0
    for a in tensors.values():
        arr = a.numpy() if hasattr(a, "numpy") else a
        crc = zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data, crc)
    return crc


def broadcast_all(tensors: Sequence[Any], src: int = 0) -> tuple[float, float]:
    """``torch.distributed.broadcast`` of every tensor from rank ``src``, in order, on
    the default process group; returns (start, end) on :func:`now`'s clock."""
    import torch.distributed as dist
    t0 = now()
    for t in tensors:
        dist.broadcast(t, src)
    return t0, now()


def _part(a: np.ndarray, shard: Any) -> np.ndarray:
    """The view of ``a`` that ``shard`` (a :class:`~smb_client.weights.Shard`) names."""
    lo, hi = shard.bounds(a.shape[shard.dim])
    return a[lo:hi] if shard.dim == 0 else a[:, lo:hi]


def read_cases(mb: int, full: Mapping[str, np.ndarray] | None = None) -> dict[str, tuple[dict[str, Any],
                                                                                        dict[str, Any]]]:
    """label -> (destination arrays, shards) of the reads :func:`time_reads` times: the
    whole version (into ``full`` when given), part 0 of :data:`SHARD_PARTS` of every
    matrix by rows, and by columns."""
    from smb_client.weights import Shard
    from smb_client.weights.shards import shard_shape
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {"full read": (dict(full or state(mb)), {})}
    for label, dim in (("row shard", 0), ("column shard", 1)):
        shard = Shard(dim, 0, SHARD_PARTS)
        into = {k: np.empty(shard_shape(s, shard), np.float32) for k, s in shapes(mb).items()}
        cases[label] = (into, {k: shard for k in into})
    return cases


def time_reads(sub: Any, mb: int, rounds: int, full: Mapping[str, np.ndarray] | None = None,
               expect: Mapping[str, np.ndarray] | None = None) -> dict[str, float]:
    """Median seconds over ``rounds`` of ``sub`` (a :class:`~smb_client.weights.Subscriber`)
    reading the latest version whole, and its 2-way row and column shards
    (:func:`read_cases`). ``expect``: the version's full contents; every read is then
    compared with it, element for element (AssertionError when one differs)."""
    out = {}
    for label, (into, shards) in read_cases(mb, full).items():
        times = []
        for _ in range(rounds):
            t0 = now()
            sub.read(into, shards=shards)
            times.append(now() - t0)
            if expect is not None:
                for k, a in into.items():
                    want = _part(expect[k], shards[k]) if k in shards else expect[k]
                    assert np.array_equal(a, want), f"{label}: {k} differs from the version published"
        out[label] = statistics.median(times)
    return out
