"""How the controller reaches memory servers: the :class:`MemoryServers` interface the
create/delete sequence (:mod:`.creation`) is written against, and its gRPC
implementation (:class:`GrpcMemoryServers`, which owns a channel per server address).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from smb_protocol import errors, rpc, tickets
from smb_protocol._proto.smb.v1 import memory_server_pb2, memory_server_pb2_grpc
from smb_protocol.replicas import ReplicaRole
from smb_protocol.tls import TLSConfig

from .records import ExtentRecord

log = logging.getLogger(__name__)

RESERVE_TIMEOUT = 10.0   # seconds for one ReserveExtent call
RELEASE_TIMEOUT = 5.0    # seconds for one ReleaseExtent call
CONFIGURE_TIMEOUT = 10.0  # seconds for one ConfigureReplicas call that syncs nothing
SYNC_TIMEOUT = 600.0      # seconds for one that copies whole extents to backups
ADMIN_TICKET_TTL = 60.0  # seconds an admin ticket for one reserve/release lives


@dataclass(frozen=True)
class Backup:
    """One backup a primary forwards to; ``sync``: not in step yet, copy it all first."""

    extent: ExtentRecord
    sync: bool = False


class MemoryServers(Protocol):
    """Reserve and release extents on memory servers; implementations are thread-safe.

    Both raise typed errors (:mod:`smb_protocol.errors`): ``OutOfMemory`` when the server
    has no room, ``ServerUnavailable`` when it cannot be reached.
    """

    def reserve(self, address: str, region_uid: str, extent: ExtentRecord,
                persistent: bool = False) -> None:
        """Reserve ``extent.length`` bytes as ``extent.extent_id`` on the server at
        ``address`` for the region ``region_uid``."""

    def release(self, address: str, region_uid: str, extent: ExtentRecord) -> bool:
        """Free the extent; True if the server held it."""

    def configure_replicas(self, address: str, region_uid: str, extent: ExtentRecord, view: int,
                           role: ReplicaRole, backups: Sequence[Backup] = ()) -> tuple[int, int]:
        """Set the extent's place in its replica set at ``view`` (role ``primary`` with
        ``backups``, or ``backup``); returns (the view in force, bytes synced to backups
        marked ``sync``, which the call copies before it returns). An older view than
        the extent's is refused (InvalidArgument); the same view is idempotent."""


class GrpcMemoryServers:
    """:class:`MemoryServers` over gRPC, with short-lived ``admin`` tickets signed with
    ``secret`` and ``token`` as bearer token. Owns one channel per address, closed by
    :meth:`close`. Timeouts in seconds. :attr:`tls`: the TLS files of channels opened
    from then on (None: the ``SMB_TLS_*`` environment)."""

    def __init__(self, secret: bytes, token: str = "",
                 reserve_timeout: float = RESERVE_TIMEOUT,
                 release_timeout: float = RELEASE_TIMEOUT) -> None:
        self.secret = secret
        self.token = token
        self.reserve_timeout = reserve_timeout
        self.release_timeout = release_timeout
        self.configure_timeout = CONFIGURE_TIMEOUT
        self.sync_timeout = SYNC_TIMEOUT
        self._stubs: dict[str, tuple[grpc.Channel, memory_server_pb2_grpc.MemoryServerStub]] = {}
        self._lock = threading.Lock()
        self.tls: TLSConfig | None = None
        self.epoch = 0  # the leader epoch admin tickets carry (0: no election)

    def _stub(self, address: str) -> memory_server_pb2_grpc.MemoryServerStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = rpc.channel(address, self.tls)
                stub = memory_server_pb2_grpc.MemoryServerStub(channel)  # type: ignore[no-untyped-call]  # generated stub, untyped __init__
                entry = (channel, stub)
                self._stubs[address] = entry
            return entry[1]

    def _admin_ticket(self, region_uid: str, extent_id: int, ttl: float = ADMIN_TICKET_TTL) -> str:
        return tickets.sign(self.secret, region_uid, [extent_id], "admin", ttl=ttl,
                            epoch=self.epoch)[0]

    def reserve(self, address: str, region_uid: str, extent: ExtentRecord,
                persistent: bool = False) -> None:
        request = memory_server_pb2.ReserveExtentRequest(
            ticket=self._admin_ticket(region_uid, extent.extent_id), extent_id=extent.extent_id,
            region_uid=region_uid, length=extent.length, persistent=persistent)
        reply = rpc.call(self._stub(address).ReserveExtent, request, self.token,
                         self.reserve_timeout, errors.ServerUnavailable)
        if reply.length and reply.length < extent.length:
            raise errors.ServerError(f"reserved {reply.length} bytes, asked for {extent.length}")

    def release(self, address: str, region_uid: str, extent: ExtentRecord) -> bool:
        request = memory_server_pb2.ReleaseExtentRequest(
            ticket=self._admin_ticket(region_uid, extent.extent_id), extent_id=extent.extent_id)
        reply = rpc.call(self._stub(address).ReleaseExtent, request, self.token,
                         self.release_timeout, errors.ServerUnavailable)
        return bool(reply.released)

    def configure_replicas(self, address: str, region_uid: str, extent: ExtentRecord, view: int,
                           role: ReplicaRole, backups: Sequence[Backup] = ()) -> tuple[int, int]:
        request = memory_server_pb2.ConfigureReplicasRequest(
            ticket=self._admin_ticket(region_uid, extent.extent_id, self.sync_timeout),
            extent_id=extent.extent_id, view=view, role=role,
            backups=[memory_server_pb2.ReplicaTarget(
                extent_id=b.extent.extent_id, server_id=b.extent.server_id,
                endpoints=list(b.extent.endpoints), sync=b.sync) for b in backups])
        timeout = self.sync_timeout if any(b.sync for b in backups) else self.configure_timeout
        reply = rpc.call(self._stub(address).ConfigureReplicas, request, self.token, timeout,
                         errors.ServerUnavailable)
        return int(reply.view), int(reply.synced_bytes)

    def close(self) -> None:
        """Close every channel; later calls open new ones."""
        with self._lock:
            stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            channel.close()
