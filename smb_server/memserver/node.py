"""The parts of one memory server that every plane and the gRPC servicer share, built
once at start and passed in: the arena, the exactly-once table, the waits and locks,
the replica configuration with its forwarding, the statistics and the secret."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from .arena import Arena
from .dedup import DedupTable
from .replication import DEAD_PEER_TIMEOUT, Replication
from .stats import PlaneStats
from .waiters import Waiters


@dataclass
class Node:
    """One memory server's shared state. Borrows ``arena`` (its owner closes it);
    :meth:`close` closes what the node made (the replication's forwarders)."""

    arena: Arena
    secret: bytes
    stats: PlaneStats = field(default_factory=PlaneStats)
    dedup: DedupTable = field(default_factory=DedupTable)
    waiters: Waiters = field(default_factory=Waiters)
    replication: Replication = field(init=False)
    #: client TLS context for reaching backups at ``tcp+tls://`` endpoints
    tls: ssl.SSLContext | None = None
    #: seconds a backup may acknowledge nothing before its primary marks it failed
    dead_peer_timeout: float = DEAD_PEER_TIMEOUT

    def __post_init__(self) -> None:
        self.replication = Replication(self.secret, self.tls, dead_peer_timeout=self.dead_peer_timeout,
                                       dedup=self.dedup)
        self.arena.add_listener(self.replication)

    def close(self) -> None:
        self.replication.close()
