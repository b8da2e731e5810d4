"""What a published set of weights looks like in the memory box: pure, no I/O.

A name ``ns/policy`` owns two regions:

* ``ns/policy/meta`` (one extent, so that its words live on one server): int64 words

  ====================  ============================================================
  word 0                :data:`MAGIC`
  word 1                the latest complete version (``-1``: none yet); readers wait on it
  word 2                ``K``, the number of buffers (versions kept)
  word 3                bytes of the manifest
  words 4 .. 4+K        each buffer's stamp (see :func:`writing` and :func:`complete`)
  words 4+K .. 4+2K     each buffer's arrivals: ranks done writing its version, as
                        ``version * ARRIVALS + ranks`` (a multi-rank publisher's)
  then                  the manifest (JSON, :class:`Manifest`)
  ====================  ============================================================

* ``ns/policy/data``: ``K`` buffers of :attr:`Manifest.slot_bytes` each; every tensor
  at the same offset in every buffer, row-major, little-endian.

A buffer's stamp is a seqlock: ``0`` empty, :func:`writing` (odd) while a version is
being written into it, :func:`complete` (even) once every byte of that version is there.
Stamps only grow, so a reader that finds the same complete stamp before and after its
reads read one whole version.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from smb_protocol.dtypes import DType, itemsize, resolve
from smb_protocol.errors import InvalidArgument, ProtocolError

log = logging.getLogger(__name__)

MAGIC = 0x31_54_48_47_49_45_57_53   # b"SWEIGHT1" read as a little-endian int64
FORMAT = 1
WORD = 8
LATEST = 1 * WORD                   # byte offset of the latest-version word
HEADER_WORDS = 4
ALIGN = 64                          # bytes: every tensor starts at a multiple of this in a buffer
ARRIVALS = 1 << 10                  # ranks of one publisher at most (packed with a version)
MAX_VERSION = (1 << 62) // ARRIVALS - 1
NONE = -1                           # the latest word before the first version


def stamp_offset(buffer: int) -> int:
    """Byte offset in the meta region of buffer ``buffer``'s stamp."""
    return (HEADER_WORDS + buffer) * WORD


def arrivals_offset(versions: int, buffer: int) -> int:
    """Byte offset in the meta region of buffer ``buffer``'s arrivals word."""
    return (HEADER_WORDS + versions + buffer) * WORD


def manifest_offset(versions: int) -> int:
    """Byte offset in the meta region where the manifest starts."""
    return (HEADER_WORDS + 2 * versions) * WORD


def header_bytes(versions: int) -> int:
    """Bytes of the words a reader reads at once: magic .. last stamp."""
    return (HEADER_WORDS + versions) * WORD


def writing(version: int) -> int:
    """The stamp of a buffer while ``version`` is being written into it (odd)."""
    return 2 * version + 1


def complete(version: int) -> int:
    """The stamp of a buffer that holds all of ``version`` (even, above 0)."""
    return 2 * version + 2


def check_version(version: object) -> int:
    """``version`` if it is a whole number from 0 to :data:`MAX_VERSION`."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise InvalidArgument(f"a version is a whole number from 0 to {MAX_VERSION}, not {version!r}")
    return version


def buffer_of(stamps: Sequence[int], version: int) -> int | None:
    """The buffer whose stamp says it holds all of ``version``; None when none does."""
    want = complete(version)
    for b, s in enumerate(stamps):
        if s == want:
            return b
    return None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a buffer: ``offset`` and ``nbytes`` in bytes from the buffer's start."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """The tensors of every version of one name, and how many versions are kept."""

    versions: int
    tensors: tuple[TensorSpec, ...]
    slot_bytes: int          # one buffer, a multiple of ALIGN
    by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {t.name: t for t in self.tensors})

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise InvalidArgument(f"no tensor {name!r} is published here; there are "
                                  f"{', '.join(self.names()[:8])}{' ...' if len(self.tensors) > 8 else ''}"
                                  ) from None

    def names(self) -> list[str]:
        """The tensors' names, in layout order."""
        return [t.name for t in self.tensors]

    @property
    def data_bytes(self) -> int:
        """Bytes of the data region: every buffer."""
        return self.versions * self.slot_bytes

    @property
    def meta_bytes(self) -> int:
        """Bytes of the meta region: the words and the manifest."""
        return manifest_offset(self.versions) + len(self.encode())

    @classmethod
    def plan(cls, shapes: Mapping[str, tuple[tuple[int, ...], Any]], versions: int) -> Manifest:
        """Lay ``name -> (shape, dtype)`` out in one buffer, in the given order."""
        if not isinstance(versions, int) or isinstance(versions, bool) or versions < 2:
            raise InvalidArgument(f"keep at least 2 versions (a reader's and the one being written), "
                                  f"not {versions!r}")
        if not shapes:
            raise InvalidArgument("nothing to publish: no tensors given")
        specs, pos = [], 0
        for name, (shape, dtype) in shapes.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"tensor names are non-empty strings, not {name!r}")
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise InvalidArgument(f"tensor {name!r} has a negative dimension: {dims}")
            dt = resolve(dtype)
            nbytes = math.prod(dims) * itemsize(dt)
            specs.append(TensorSpec(name, dt, dims, pos, nbytes))
            pos += -(-nbytes // ALIGN) * ALIGN
        return cls(versions, tuple(specs), max(ALIGN, pos))

    def encode(self) -> bytes:
        """The manifest as stored (JSON)."""
        return json.dumps({"format": FORMAT, "versions": self.versions, "slot_bytes": self.slot_bytes,
                           "tensors": [[t.name, t.dtype.name.lower(), list(t.shape), t.offset, t.nbytes]
                                       for t in self.tensors]}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        """From :meth:`encode`'s bytes (ProtocolError when unreadable)."""
        try:
            doc = json.loads(raw)
            if doc["format"] != FORMAT:
                raise ProtocolError(f"published weights of format {doc['format']}; this client reads {FORMAT}")
            tensors = tuple(TensorSpec(n, resolve(d), tuple(s), o, b) for n, d, s, o, b in doc["tensors"])
            return cls(int(doc["versions"]), tensors, int(doc["slot_bytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"unreadable manifest of published weights: {exc}") from None


def meta_name(name: str) -> str:
    """The meta region of published name ``name``."""
    return f"{name}/meta"


def data_name(name: str) -> str:
    """The data region of published name ``name``."""
    return f"{name}/data"
