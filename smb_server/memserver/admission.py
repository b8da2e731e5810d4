"""How a listener counts the connections it admitted (see :mod:`.listener`): pure
bookkeeping, no sockets touched here and no lock of its own (the listener holds its
lock around every call).

A connection is either *pending* (admitted, not yet authenticated: it counts against
``max_unauthenticated`` only), *counted* (against ``max_connections`` in all and
``max_per_peer`` from its peer), or *evicted* (shed for a newer pending one; it counts
nowhere while its thread ends). Without ``max_unauthenticated`` every connection is
counted from its accept.
"""
from __future__ import annotations

import socket
from collections import OrderedDict
from collections.abc import Callable

from smb_protocol.errors import ServerBusy, SMBError

PENDING = "pending"
COUNTED = "counted"
EVICTED = "evicted"


class Admission:
    """One admitted connection: its socket, peer key (what the per-peer limit counts),
    peer name (for logs) and state. The plane gets it from ``Listener.current()`` on the
    connection's thread."""

    __slots__ = ("sock", "key", "peer", "state", "_authenticate")

    def __init__(self, sock: socket.socket, key: str, peer: str,
                 authenticate: Callable[[Admission], None]) -> None:
        self.sock = sock
        self.key = key
        self.peer = peer
        self.state = PENDING
        self._authenticate = authenticate

    def authenticated(self) -> None:
        """Count this connection as authenticated from now on (idempotent). Raises
        :class:`ServerBusy` when its peer's or the listener's authenticated connections
        are at their limit, or when it was evicted meanwhile; the plane answers with it
        and closes the connection."""
        self._authenticate(self)


class Ledger:
    """The counts behind a listener's admission decisions. ``*_setting`` name the
    settings that raise each limit, for refusal messages."""

    def __init__(self, max_connections: int, max_per_peer: int | None,
                 max_unauthenticated: int | None, max_setting: str = "",
                 per_peer_setting: str = "", unauthenticated_setting: str = "") -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_unauthenticated = max_unauthenticated
        self._max_setting = max_setting
        self._per_peer_setting = per_peer_setting
        self._unauthenticated_setting = unauthenticated_setting
        self.counted = 0                                   # counted connections in all
        self._per_peer: dict[str, int] = {}                # counted connections by peer key
        self._pending: dict[str, OrderedDict[socket.socket, Admission]] = {}  # by peer, oldest first
        self.pending = 0

    def refusal(self, key: str) -> SMBError | None:
        """Why a connection from ``key`` cannot be counted now, or None."""
        if self.counted >= self.max_connections:
            setting = f" ({self._max_setting})" if self._max_setting else ""
            return ServerBusy(
                f"the memory server is full: {self.counted} data-plane connections "
                f"open, the limit{setting}; retry later, close idle clients, "
                f"or raise it")
        if self.max_per_peer is not None and self._per_peer.get(key, 0) >= self.max_per_peer:
            setting = f" ({self._per_peer_setting})" if self._per_peer_setting else ""
            return ServerBusy(
                f"{self._per_peer[key]} data-plane connections are open from {key}, the per-peer "
                f"limit{setting}; close idle connections or raise it")
        return None

    def add(self, admission: Admission) -> Admission | None:
        """Take in a new connection: pending, or counted when there is no budget for
        pending ones. Returns the pending connection evicted to make room, if any (marked
        evicted here; the caller sheds its socket)."""
        if self.max_unauthenticated is None:
            self._count(admission)
            return None
        victim = self._evict() if self.pending >= self.max_unauthenticated else None
        self._pending.setdefault(admission.key, OrderedDict())[admission.sock] = admission
        self.pending += 1
        return victim

    def authenticate(self, admission: Admission) -> SMBError | None:
        """Count a pending connection; the error that refuses it (it then stays pending),
        or None. Counted already: nothing to do."""
        if admission.state == COUNTED:
            return None
        if admission.state == EVICTED:
            return self.eviction_error()
        refusal = self.refusal(admission.key)
        if refusal is None:
            self._unpend(admission)
            self._count(admission)
        return refusal

    def remove(self, admission: Admission) -> None:
        """Forget a connection that ended."""
        if admission.state == PENDING:
            self._unpend(admission)
        elif admission.state == COUNTED:
            self.counted -= 1
            left = self._per_peer.get(admission.key, 1) - 1
            if left > 0:
                self._per_peer[admission.key] = left
            else:
                self._per_peer.pop(admission.key, None)

    def eviction_error(self) -> ServerBusy:
        setting = f" ({self._unauthenticated_setting})" if self._unauthenticated_setting else ""
        return ServerBusy(
            f"the memory server closed this connection before it authenticated: "
            f"{self.max_unauthenticated} connections are waiting to authenticate, the limit"
            f"{setting}, and this was the oldest of the peer holding the most; retry")

    def _count(self, admission: Admission) -> None:
        admission.state = COUNTED
        self.counted += 1
        self._per_peer[admission.key] = self._per_peer.get(admission.key, 0) + 1

    def _unpend(self, admission: Admission) -> None:
        queue = self._pending.get(admission.key)
        if queue is not None and queue.pop(admission.sock, None) is not None:
            self.pending -= 1
            if not queue:
                del self._pending[admission.key]

    def _evict(self) -> Admission:
        """The oldest pending connection of the peer with the most pending ones, now
        evicted."""
        key = max(self._pending, key=lambda k: len(self._pending[k]))
        victim = next(iter(self._pending[key].values()))
        self._unpend(victim)
        victim.state = EVICTED
        return victim
