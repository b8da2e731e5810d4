"""The reading side: wait server-side for a newer version, read one whole version.

A :class:`Subscriber` waits on the latest-version word (the memory server answers when
the publisher raises it: no polling), then reads the buffer whose stamp says it holds
that version and reads the stamp again: unchanged, the bytes are that version's;
changed, the publisher reused the buffer meanwhile and the read is done again on the
newest version (or :class:`~smb_protocol.errors.VersionGone` is raised). A reader holds
nothing on the servers, so one that dies holds nothing back.

Reads take any set of tensors, each whole or a :class:`~.shards.Shard`, into the
caller's arrays or tensors (CPU) or new numpy arrays, straight into their memory; a
float type other than the published one is converted through two small staging buffers
(:data:`STAGE_BYTES` each), the next piece read while the last is converted.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smb_protocol.dtypes import FLOATING, STORAGE, DType, itemsize, resolve
from smb_protocol.errors import InvalidArgument, NotFound, VersionGone

from ..buffers import as_view
from ..client import Client
from .gather import check_conversion, convert, read_pieces, storage_view
from .manifest import (
    HEADER_WORDS,
    LATEST,
    NONE,
    WORD,
    TensorSpec,
    buffer_of,
    complete,
    data_name,
    meta_name,
    stamp_offset,
)
from .publisher import load_manifest, read_words
from .shards import Shard, shard_runs, shard_shape

log = logging.getLogger(__name__)

RETRIES = 8                 # reads of a newer version after a torn one, before VersionGone
STAGE_BYTES = 8 << 20       # bytes of each of the two staging buffers of a converting read


@dataclass
class Snapshot:
    """One whole version: its number and name -> the array or tensor read."""

    version: int
    tensors: dict[str, Any]


@dataclass
class _Convert:
    stage: int           # byte offset in the staging buffer
    nbytes: int          # of the published type
    spec: TensorSpec
    out: np.ndarray      # the whole destination, flat, of its storage type
    dst: DType
    start: int           # first destination element


@dataclass
class _Round:
    pieces: list[tuple[int, int, int]] = field(default_factory=list)   # (offset in a buffer, bytes, stage)
    converts: list[_Convert] = field(default_factory=list)
    used: int = 0


@dataclass
class _Plan:
    direct: list[tuple[int, memoryview]]      # (offset in a buffer, destination bytes)
    rounds: list[_Round]
    tensors: dict[str, Any]


class Subscriber:
    """Reads the versions published under ``name`` (RegionNotFound when there is none).
    Opens its regions read-only; borrows the client. :attr:`version` is the last
    version read (None before the first)."""

    def __init__(self, client: Client, name: str, *, retries: int = RETRIES) -> None:
        self.client, self.name, self.retries = client, name, retries
        self.meta = client.open_region(meta_name(name), "ro")
        self.manifest = load_manifest(self.meta)
        self.data = client.open_region(data_name(name), "ro")
        self.version: int | None = None
        self.requests = 0          # data requests of the last read (torn tries included)

    @property
    def versions(self) -> int:
        """Versions the publisher keeps."""
        return self.manifest.versions

    def names(self) -> list[str]:
        """The published tensors' names."""
        return self.manifest.names()

    def latest(self) -> int | None:
        """The latest complete version (None: nothing published yet)."""
        v = int(self.meta.read(LATEST, WORD, dtype=np.int64)[0])
        return None if v == NONE else v

    def wait(self, newer_than: int | None = None, timeout: float | None = None) -> int:
        """Block until a version newer than ``newer_than`` (None: any) is complete; the
        latest then. Served by the memory server (no polling); Timeout after ``timeout`` s."""
        target = 0 if newer_than is None else newer_than + 1
        return self.meta.wait(LATEST, value=target, timeout=timeout)

    def next(self, into: Mapping[str, Any] | None = None, *, timeout: float | None = None,
             names: Sequence[str] | None = None, shards: Mapping[str, Shard | None] | None = None,
             dtype: Any = None, retry: bool = True) -> Snapshot:
        """:meth:`wait` for a version newer than the last read, then :meth:`read` it
        (``names`` through ``retry`` are :meth:`read`'s)."""
        self.wait(self.version, timeout)
        return self.read(into, names=names, shards=shards, dtype=dtype, retry=retry)

    def read(self, into: Mapping[str, Any] | None = None, *, names: Sequence[str] | None = None,
             shards: Mapping[str, Shard | None] | None = None, dtype: Any = None,
             version: int | None = None, retry: bool = True) -> Snapshot:
        """Read one whole version: the latest, or ``version`` (VersionGone once it is no
        longer kept).

        ``into``: name -> a contiguous CPU array or tensor to fill (its type may be
        another float type than the published one); else ``names`` (default: all) are
        read into new numpy arrays (bfloat16 as uint16 bit patterns), floats as ``dtype``
        when given. ``shards``: name -> the :class:`Shard` of that tensor to read (a
        tensor not named is read whole). When the publisher reuses the buffer during the
        read, read the newest instead (``retry``, up to :attr:`retries` times) or raise
        VersionGone; after a VersionGone what ``into`` holds is no version.
        """
        plan = self._plan(into, names, shards, dtype)
        self.requests = 0
        for _ in range(self.retries + 1):
            words = read_words(self.meta, self.versions)
            latest = int(words[1])
            want = latest if version is None else version
            if want == NONE:
                raise NotFound(f"nothing is published under {self.name!r} yet; wait() for a version first")
            b = buffer_of(words[HEADER_WORDS:].tolist(), want)
            if b is None:
                if version is not None:
                    raise VersionGone(f"{self.name!r}: version {version} is no longer kept (latest {latest}, "
                                      f"{self.versions} versions kept)")
                continue             # the words were read as the latest changed
            self._fill(plan, b * self.manifest.slot_bytes)
            after = int(self.meta.read(stamp_offset(b), WORD, dtype=np.int64)[0])
            if after == complete(want):
                self.version = want
                return Snapshot(want, plan.tensors)
            if version is not None or not retry:
                raise VersionGone(f"{self.name!r}: version {want} was overwritten while it was read; "
                                  "read the newest, or keep more versions")
            log.debug("%s: version %d overwritten while read, reading the newest", self.name, want)
        raise VersionGone(f"{self.name!r}: {self.retries + 1} versions in a row were overwritten while they "
                          f"were read; keep more than {self.versions} versions or publish less often")

    # -- planning ------------------------------------------------------------------
    def _plan(self, into: Mapping[str, Any] | None, names: Sequence[str] | None,
              shards: Mapping[str, Shard | None] | None, dtype: Any) -> _Plan:
        if into is not None and names is not None:
            raise InvalidArgument("pass into= or names=, not both: into's keys name the tensors")
        chosen = list(into) if into is not None else list(names) if names is not None else self.names()
        shards = dict(shards or {})
        unknown = set(shards) - set(chosen)
        if unknown:
            raise InvalidArgument(f"shards given for tensors not read: {sorted(unknown)[:5]}")
        want = None if dtype is None else resolve(dtype)
        plan = _Plan([], [], {})
        for name in chosen:
            spec = self.manifest[name]
            shard = shards.get(name)
            shape = shard_shape(spec.shape, shard)
            if into is not None:
                target = into[name]
                view, dst_or_none = as_view(target, writable=True)
                dst = dst_or_none or spec.dtype
                if len(view) != math.prod(shape) * itemsize(dst):
                    raise InvalidArgument(f"{name!r}: the buffer holds {len(view)} bytes; its "
                                          f"{'shard' if shard else 'tensor'} of shape {shape} needs "
                                          f"{math.prod(shape) * itemsize(dst)} as {dst.name.lower()}")
            else:
                dst = want if want is not None and spec.dtype in FLOATING else spec.dtype
                target = np.empty(shape, dtype=STORAGE[dst])
                view = as_view(target, writable=True)[0]
            check_conversion(spec.dtype, dst, repr(name))
            plan.tensors[name] = target
            runs = shard_runs(spec.shape, itemsize(spec.dtype), shard)
            if dst == spec.dtype:
                pos = 0
                for off, n in runs:
                    plan.direct.append((spec.offset + off, view[pos:pos + n]))
                    pos += n
            else:
                self._stage(plan.rounds, spec, runs, storage_view(view, dst), dst)
        return plan

    @staticmethod
    def _stage(rounds: list[_Round], spec: TensorSpec, runs: list[tuple[int, int]], out: np.ndarray,
               dst: DType) -> None:
        """Cut ``runs`` into staging rounds of at most STAGE_BYTES, each piece converted
        into ``out`` from element ``start`` on."""
        size = itemsize(spec.dtype)
        start = 0
        if rounds:
            rounds[-1].used = -(-rounds[-1].used // WORD) * WORD      # each tensor aligned in the stage
        for off, n in runs:
            while n:
                if not rounds or rounds[-1].used + size > STAGE_BYTES:
                    rounds.append(_Round())
                r = rounds[-1]
                take = min(n, (STAGE_BYTES - r.used) // size * size)
                r.pieces.append((spec.offset + off, take, r.used))
                last = r.converts[-1] if r.converts else None
                if last is not None and last.spec is spec and last.stage + last.nbytes == r.used:
                    last.nbytes += take
                else:
                    r.converts.append(_Convert(r.used, take, spec, out, dst, start))
                r.used += take
                start += take // size
                off += take
                n -= take

    # -- reading -------------------------------------------------------------------
    def _fill(self, plan: _Plan, base: int) -> None:
        """Read the plan from the buffer at byte ``base`` of the data region."""
        route = self.data.route
        direct: Future[int] | None = None
        if plan.direct:
            direct = route.submit(read_pieces, self.data, [(base + off, v) for off, v in plan.direct])
        if plan.rounds:
            size = STAGE_BYTES if len(plan.rounds) > 1 else plan.rounds[0].used
            stages = [memoryview(bytearray(size)) for _ in plan.rounds[:2]]
            pending = self._read_round(plan.rounds[0], stages[0], base)
            for k, r in enumerate(plan.rounds):
                self.requests += pending.result()
                if k + 1 < len(plan.rounds):
                    pending = self._read_round(plan.rounds[k + 1], stages[(k + 1) % 2], base)
                stage = stages[k % 2]
                for c in r.converts:
                    src = storage_view(stage[c.stage:c.stage + c.nbytes], c.spec.dtype)
                    convert(src, c.spec.dtype, c.out[c.start:c.start + len(src)], c.dst)
        if direct is not None:
            self.requests += direct.result()

    def _read_round(self, r: _Round, stage: memoryview, base: int) -> Future[int]:
        pieces = [(base + off, stage[pos:pos + n]) for off, n, pos in r.pieces]
        return self.data.route.submit(read_pieces, self.data, pieces)
