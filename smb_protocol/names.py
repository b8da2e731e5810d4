"""Region and barrier names: what is allowed, checked in one pure function.

A region name is ``namespace/name`` (more levels allowed: ``job/layer/3``): segments of
letters, digits, ``.``, ``_`` and ``-`` joined by ``/``, at least two of them, none
empty and none ``.`` or ``..``, at most :data:`MAX_NAME_LENGTH` characters in all.
The controller enforces it; a client may call :func:`check_region_name` first to fail
without a round trip (and before sending a name too large for a gRPC message).
"""
from __future__ import annotations

import re

from .errors import InvalidArgument

MAX_NAME_LENGTH = 255  # characters of a region or barrier name
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_ALLOWED = ("'namespace/name' (e.g. 'job/params'): segments of letters, digits, '.', '_' "
            f"and '-' joined by '/', at most {MAX_NAME_LENGTH} characters")


def check_region_name(name: object) -> str:
    """Return ``name`` if it is a valid region name; raise InvalidArgument saying what
    is allowed otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"region name must not be empty; use {_ALLOWED}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"region name is {len(name)} characters long; use {_ALLOWED}")
    segments = name.split("/")
    if len(segments) < 2:
        raise InvalidArgument(f"region name {name!r} has no namespace; use {_ALLOWED}")
    for segment in segments:
        if not segment:
            raise InvalidArgument(f"region name {name!r} has an empty segment; use {_ALLOWED}")
        if segment in (".", ".."):
            raise InvalidArgument(f"region name {name!r}: segment {segment!r} is not allowed; "
                                  f"use {_ALLOWED}")
        if not _SEGMENT.fullmatch(segment):
            raise InvalidArgument(f"region name {name!r}: segment {segment!r} has characters "
                                  f"that are not allowed; use {_ALLOWED}")
    return name


def check_barrier_name(name: object) -> str:
    """Return ``name`` if it is a valid barrier name (1 to MAX_NAME_LENGTH characters)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        size = len(name) if isinstance(name, str) else 0
        raise InvalidArgument(f"barrier name must be 1 to {MAX_NAME_LENGTH} characters, "
                              f"got {size}")
    return name
