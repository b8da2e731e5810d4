"""How a :class:`~smb_client.collective.Collective` lays its buffer out over the servers.

A buffer of ``nbytes`` becomes chunks of at most ``chunk_bytes``; each chunk is a
segment of a ``layered`` region, whole on one memory server::

    chunk i:  slot 0 (chunk bytes) | slot 1 (chunk bytes) | count 0 | count 1 | members | padding to 64 bytes

The segments are dealt to the servers evenly, or in proportion to weights derived from
where the workers run (:func:`server_weights`). Pure functions of their arguments but for
:func:`server_weights`, which asks the controller which servers are up.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from smb_protocol import wire
from smb_protocol.errors import InvalidArgument
from smb_protocol.placement import check_weights, chunk_shares

if TYPE_CHECKING:
    from .client import Client

__all__ = ["CHUNK_BYTES", "segment_sizes", "default_chunk", "server_weights", "chunk_bytes_for"]

CHUNK_BYTES = 512 << 10        # largest default chunk, bytes: see default_chunk
MIN_CHUNK = 64 << 10           # smallest default chunk, bytes
CHUNKS_PER_SERVER = 4          # default chunks per server at least, for overlap and balance
TAIL = 64                      # bytes after a chunk's two slots: two count words, the members word, padding
MEMBERS = 16                   # offset in chunk 0's tail of the word that counts the parties that joined
MAX_SHARE_SERVERS = 64         # weighted default chunks: as for at most this many even servers


def check_parties(parties: object) -> None:
    """InvalidArgument unless ``parties`` is a positive number."""
    if not isinstance(parties, int) or parties < 1:
        raise InvalidArgument(f"parties must be a positive number, not {parties!r}")


def segment_sizes(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """The segments of a collective of ``nbytes`` with chunks of ``chunk_bytes``."""
    if not isinstance(nbytes, int) or nbytes < 1:
        raise InvalidArgument(f"nbytes must be a positive number of bytes, not {nbytes!r}")
    if not isinstance(chunk_bytes, int) or not 8 <= chunk_bytes <= wire.MAX_CHUNK or chunk_bytes % 8:
        raise InvalidArgument(f"chunk_bytes must be a multiple of 8 from 8 to {wire.MAX_CHUNK}, "
                              f"not {chunk_bytes!r}")
    sizes, left = [], nbytes
    while left:
        n = min(chunk_bytes, left)
        sizes.append(2 * n + TAIL)
        left -= n
    return sizes


def default_chunk(nbytes: int, servers: int) -> int:
    """Chunk bytes for ``nbytes`` over ``servers``: at most :data:`CHUNK_BYTES`, and
    small enough that every server gets :data:`CHUNKS_PER_SERVER` chunks (so that
    pushes and pulls overlap and the servers share the work), at least
    :data:`MIN_CHUNK`."""
    want = -(-nbytes // (max(1, servers) * CHUNKS_PER_SERVER))
    return max(MIN_CHUNK, min(CHUNK_BYTES, -(-want // 4096) * 4096))


def chunk_bytes_for(client: Client, nbytes: int, weights: Mapping[str, float] | None, num_servers: int) -> int:
    """The default chunk of a collective of ``nbytes`` placed by ``weights`` (enough
    chunks that the smallest share gets :data:`CHUNKS_PER_SERVER`) or over
    ``num_servers`` servers (0: every server that is up)."""
    if weights is not None:
        share = min(weights.values()) / sum(weights.values())
        count = min(MAX_SHARE_SERVERS, math.ceil(1 / share - 1e-9))
    else:
        count = num_servers or sum(1 for s in client.list_servers() if s.state == "up")
    return default_chunk(nbytes if isinstance(nbytes, int) else 0, count)


def server_weights(client: Client, worker_hosts: Sequence[str] | None = None,
                   servers: Sequence[str] | Mapping[str, float] | None = None) -> dict[str, float] | None:
    """The server weights a collective's region asks for (positive ones only), or None
    for the default placement (neither argument given). See
    :meth:`Collective.create <smb_client.collective.Collective.create>`."""
    if isinstance(servers, Mapping):
        weights = check_weights(servers)
    elif worker_hosts is None and servers is None:
        return None
    else:
        up = {s.server_id: s.host_id for s in client.list_servers() if s.state == "up"}
        if servers is not None:
            if isinstance(servers, str) or not servers:
                raise InvalidArgument(f"servers must be server ids, not {servers!r}")
            missing = sorted(set(servers) - set(up))
            if missing:
                raise InvalidArgument(f"server(s) {', '.join(missing)} are not up (up: {', '.join(sorted(up))})")
            up = {sid: up[sid] for sid in servers}
        if worker_hosts is None:
            weights = {sid: 1.0 for sid in up}
        else:
            weights = chunk_shares(up, list(worker_hosts))
    return {sid: w for sid, w in weights.items() if w > 0}
