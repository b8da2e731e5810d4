"""The publishing side: versions written into buffers no reader is sent to.

A :class:`Publisher` writes each version into the buffer after the latest one's (so
with ``K`` buffers the last ``K - 1`` complete versions stay readable while the next is
written), marks it :func:`~.manifest.writing` first and :func:`~.manifest.complete`
after every byte is acknowledged, then raises the latest-version word that subscribers
wait on. It never waits for readers: one still reading a buffer being reused sees its
stamp change and gets :class:`~smb_protocol.errors.VersionGone` (or reads the newest).

Several ranks may publish one version together (``ranks``), each writing its own
tensors; the last to finish completes the version. Every rank publishes every version,
in the same order.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from smb_protocol.dtypes import resolve
from smb_protocol.errors import DtypeError, InvalidArgument, RegionExists, ServerError

from ..client import Client
from ..region import Region
from .manifest import (
    ARRIVALS,
    HEADER_WORDS,
    LATEST,
    MAGIC,
    NONE,
    WORD,
    Manifest,
    arrivals_offset,
    buffer_of,
    check_version,
    complete,
    data_name,
    header_bytes,
    manifest_offset,
    meta_name,
    stamp_offset,
    writing,
)

log = logging.getLogger(__name__)

CAS_TRIES = 64     # compare-and-swap attempts on one word before giving up (ranks racing)


def _shape_and_type(value: Any) -> tuple[tuple[int, ...], Any]:
    if isinstance(value, tuple) and len(value) == 2 and not hasattr(value, "dtype"):
        return tuple(value[0]), value[1]
    return tuple(value.shape), value.dtype


OPEN_TIMEOUT = 30.0   # seconds an opener waits for a header being written to be whole


def load_manifest(meta: Region, timeout: float = OPEN_TIMEOUT) -> Manifest:
    """The manifest of a meta region (waiting, server-side, for its creator to finish it)."""
    magic = int(meta.read(0, WORD, dtype=np.int64)[0])
    if magic != MAGIC:
        meta.wait(0, equals=MAGIC, timeout=timeout)
    words = meta.read(0, HEADER_WORDS * WORD, dtype=np.int64)
    versions, length = int(words[2]), int(words[3])
    return Manifest.decode(bytes(meta.read(manifest_offset(versions), length)))


def read_words(meta: Region, versions: int) -> np.ndarray:
    """The header words (magic .. the last stamp) in one read."""
    out: np.ndarray = meta.read(0, header_bytes(versions), dtype=np.int64)
    return out


class Publisher:
    """Publishes versions of a fixed set of tensors under ``name`` (see the module).

    Made by :meth:`create` (the regions) or :meth:`open` (of an existing name: another
    rank, or a publisher restarted after a crash). Borrows the client.
    """

    def __init__(self, client: Client, name: str, meta: Region, data: Region, manifest: Manifest,
                 rank: int = 0, ranks: int = 1) -> None:
        if not isinstance(ranks, int) or not 1 <= ranks < ARRIVALS or not 0 <= rank < ranks:
            raise InvalidArgument(f"rank {rank!r} of {ranks!r}: need 0 <= rank < ranks < {ARRIVALS}")
        self.client, self.name, self.meta, self.data, self.manifest = client, name, meta, data, manifest
        self.rank, self.ranks = rank, ranks
        words = read_words(meta, manifest.versions)
        self.latest: int | None = None if words[1] == NONE else int(words[1])
        held = None if self.latest is None else buffer_of(words[HEADER_WORDS:].tolist(), self.latest)
        self._next = 0 if held is None else held + 1     # buffer index (mod K) of the next version
        self._stamps = [int(s) for s in words[HEADER_WORDS:]]
        self._open: int | None = None    # the version begun and not finished
        self._buffer = 0                 # its buffer

    @property
    def versions(self) -> int:
        """Versions kept (buffers)."""
        return self.manifest.versions

    @classmethod
    def create(cls, client: Client, name: str, tensors: Mapping[str, Any], *, versions: int = 2,
               replicas: int = 1, stripe_unit: int = 0, num_servers: int = 0, lease: float | None = None,
               exist_ok: bool = False, ranks: int = 1, rank: int = 0) -> Publisher:
        """Make the regions of ``name`` for ``tensors`` (name -> an array or tensor, or a
        ``(shape, dtype)`` pair; their order is the layout's) keeping ``versions``
        versions, striped (``stripe_unit``, ``num_servers``) with ``replicas`` copies.
        ``exist_ok``: open them instead when they exist with the same tensors."""
        manifest = Manifest.plan({k: _shape_and_type(v) for k, v in tensors.items()}, versions)
        try:
            data = client.create_region(data_name(name), manifest.data_bytes, stripe_unit=stripe_unit,
                                        num_servers=num_servers, replicas=replicas, lease=lease)
        except RegionExists:
            if not exist_ok:
                raise
            pub = cls.open(client, name, rank=rank, ranks=ranks)
            if pub.manifest != manifest:
                raise InvalidArgument(f"{name!r} is published with other tensors or versions") from None
            return pub
        raw = manifest.encode()
        meta = client.create_region(meta_name(name), manifest.meta_bytes, placement="single",
                                    replicas=replicas, lease=lease)
        words = np.zeros(HEADER_WORDS + 2 * versions, dtype=np.int64)
        words[1:4] = (NONE, versions, len(raw))
        meta.write(WORD, words[1:])
        meta.write(manifest_offset(versions), raw)
        meta.write(0, np.array([MAGIC], dtype=np.int64))      # last: the header is whole
        return cls(client, name, meta, data, manifest, rank, ranks)

    @classmethod
    def open(cls, client: Client, name: str, *, rank: int = 0, ranks: int = 1) -> Publisher:
        """Publish under an existing ``name`` (RegionNotFound when there is none)."""
        meta = client.open_region(meta_name(name))
        manifest = load_manifest(meta)
        return cls(client, name, meta, client.open_region(data_name(name)), manifest, rank, ranks)

    def delete(self) -> None:
        """Delete the regions (readers get RegionNotFound)."""
        for region in (meta_name(self.name), data_name(self.name)):
            self.client.delete_region(region)

    # -- publishing ----------------------------------------------------------------
    def publish(self, tensors: Mapping[str, Any], version: int | None = None) -> int:
        """Write ``tensors`` (every one published; with ``ranks`` > 1 this rank's) as
        ``version`` (default: one more than the last) and return it. Returns once the
        bytes are acknowledged; with one rank the version is then the latest."""
        if self.ranks == 1:
            missing = set(self.manifest.names()) - set(tensors)
            if missing:
                raise InvalidArgument(f"publish every tensor: {sorted(missing)[:5]} missing")
        version = self.begin(version)
        self.write(tensors)
        self.finish()
        return version

    def begin(self, version: int | None = None) -> int:
        """Start writing ``version`` (then :meth:`write`, :meth:`finish`): mark its buffer
        as being written."""
        if self._open is not None:
            raise InvalidArgument(f"version {self._open} is still being written; finish() it first")
        if version is None:
            version = 0 if self.latest is None else self.latest + 1
        check_version(version)
        if self.latest is not None and version <= self.latest:
            raise InvalidArgument(f"version {version} is not newer than the latest, {self.latest}")
        b = self._next % self.versions
        self._raise_word(stamp_offset(b), writing(version), self._stamps[b], take_any=True)
        self._open = version
        self._buffer = b
        return version

    def write(self, tensors: Mapping[str, Any]) -> None:
        """Write some tensors of the version begun (all servers in parallel)."""
        if self._open is None:
            raise InvalidArgument("begin() a version before writing it")
        base = self._buffer * self.manifest.slot_bytes
        items = []
        for name, value in tensors.items():
            spec = self.manifest[name]
            shape, dtype = tuple(value.shape), resolve(value.dtype)
            if dtype != spec.dtype or int(np.prod(shape)) != spec.numel:
                raise DtypeError(f"{name!r} is published as {spec.dtype.name.lower()} {spec.shape}, "
                                 f"not {dtype.name.lower()} {shape}")
            items.append((base + spec.offset, value))
        if items:
            self.data.write_many(items)

    def finish(self) -> bool:
        """End the version begun: complete it (with several ranks: once every rank
        finished). True when this call made it the latest."""
        version, b = self._open, self._buffer
        if version is None:
            raise InvalidArgument("no version begun")
        self._open = None
        self._next += 1
        if self.ranks > 1 and not self._arrive(b, version):
            self.latest = version
            return False
        old = self.meta.compare_swap(stamp_offset(b), writing(version), complete(version))
        if old != writing(version):
            log.warning("%s: version %d was taken over in buffer %d (stamp %d)", self.name, version, b, old)
            return False
        self._stamps[b] = complete(version)
        self._raise_word(LATEST, version, NONE if self.latest is None else self.latest)
        self.latest = version
        return True

    def abandon(self) -> None:
        """Give up the version begun: readers stay on the latest."""
        self._open = None

    def _arrive(self, b: int, version: int) -> bool:
        """Count this rank done with ``version`` in buffer ``b``; True for the last rank."""
        at = arrivals_offset(self.versions, b)
        expected = 0
        for _ in range(CAS_TRIES):
            held, count = divmod(expected, ARRIVALS)
            if held > version:
                return False                       # a later version took the buffer
            new = expected + 1 if held == version else version * ARRIVALS + 1
            old = self.meta.compare_swap(at, expected, new)
            if old == expected:
                return new % ARRIVALS == self.ranks
            expected = old
        raise ServerError(f"{self.name}: arrivals word of buffer {b} kept changing")

    def _raise_word(self, offset: int, value: int, expected: int, take_any: bool = False) -> None:
        """Set the word at ``offset`` to ``value`` unless it is already at least that
        (``take_any``: unless it is exactly that)."""
        for _ in range(CAS_TRIES):
            old = self.meta.compare_swap(offset, expected, value)
            if old == expected or old == value or (old > value and not take_any):
                return
            expected = old
        raise ServerError(f"{self.name}: word at {offset} kept changing")
