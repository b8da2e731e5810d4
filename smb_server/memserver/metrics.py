"""What a memory server exposes on ``/metrics``: gauges of its arena, counters and
latencies of its data planes, read at scrape time (names listed in docs/operations.md)."""
from __future__ import annotations

import threading
from typing import Protocol

from smb_server.runtime.metrics import Registry, Source

from . import _native
from .arena import Arena
from .replication import Replication
from .service import rss_bytes
from .stats import COUNTERS, PlaneStats


class ServerIdentity(Protocol):
    server_id: str
    grpc_address: str

    @property
    def registered(self) -> threading.Event: ...   # set while the controller accepted us


def add_server_metrics(reg: Registry, server: ServerIdentity, arena: Arena, stats: PlaneStats,
                       replication: Replication | None = None) -> None:
    """Register a memory server's metrics in ``reg`` (with ``replication``: its forwarding)."""
    def per_transport(name: str) -> Source:
        return lambda: [((t,), c[name]) for t, c in stats.by_transport().items()]

    reg.gauge("smb_server_info", "Always 1; labels name this memory server", ["server_id", "grpc_address"],
              fn=lambda: [((server.server_id, server.grpc_address), 1)])
    reg.gauge("smb_server_registered", "1 while the controller has accepted this server",
              fn=lambda: [((), int(server.registered.is_set()))])
    reg.gauge("smb_server_capacity_bytes", "Bytes this server may hand out",
              fn=lambda: [((), arena.capacity)])
    reg.gauge("smb_server_used_bytes", "Bytes held in extents", fn=lambda: [((), arena.used)])
    reg.gauge("smb_server_extents", "Extents held", fn=lambda: [((), len(arena))])
    reg.gauge("smb_server_regions", "Regions with at least one extent here",
              fn=lambda: [((), len({e.region_uid for e in arena.extents()}))])
    reg.gauge("smb_server_resident_bytes", "Resident memory of this process",
              fn=lambda: [((), rss_bytes())])
    reg.gauge("smb_server_sessions", "Open data-plane sessions", ["transport"],
              fn=per_transport("sessions"))
    for name in COUNTERS:
        if name == "sessions":
            continue
        what = name.replace("_", " ")
        reg.counter(f"smb_server_{name}_total", f"Data-plane {what} (see docs/operations.md for "
                    "what each transport can count)", ["transport"], fn=per_transport(name))
    reg.register(stats.latency)
    reg.counter("smb_server_chunk_pushes_total", "Collective chunk pushes that took their step, by whether "
                "they found the chunk's lock free or waited for it (another push of the chunk, or another "
                "operation on its extent, held it)", ["lock"], fn=_pushes)
    if replication is None:
        return
    counts = replication.counts
    for name, doc in (("pieces", "Pieces of mutations a primary forwarded to its backups (one per backup)"),
                      ("bytes", "Payload bytes a primary forwarded to its backups"),
                      ("sync_bytes", "Bytes copied to backups being synced"),
                      ("failures", "Backups this server marked failed while forwarding or syncing")):
        reg.counter(f"smb_server_replica_{name}_total", doc,
                    fn=_count_of(counts, name))


def _pushes() -> list[tuple[tuple[str], int]]:
    pushes, waited = _native.push_counts()
    return [(("free",), pushes - waited), (("waited",), waited)]


def _count_of(counts: dict[str, int], name: str) -> Source:
    """A source reading ``counts[name]`` at scrape time."""
    return lambda: [((), counts[name])]
