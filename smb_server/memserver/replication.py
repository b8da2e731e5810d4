"""Replicated extents on a memory server: each extent's place in its replica set, and
the forwarding of a primary's mutations to its backups.

The controller sets an extent's role with ``ConfigureReplicas`` (:meth:`Replication.configure`):

* ``""``: unreplicated, today's behaviour;
* ``backup``: mutations come only from the primary, as *pieces* on a tcp connection
  that presented a ``replica`` ticket of at least the extent's view (the tcp plane
  serves them, see :func:`.replica_ops.piece_what` and ``docs/architecture.md``, Replicated
  regions); every other mutation is answered :class:`NotPrimary`. Reads work as usual;
* ``primary``: the tcp plane applies every mutation piece by piece under the extent's
  lock and, still under it, forwards the piece to every backup and waits for the
  answers (:meth:`Replication.forward`), so each byte changes in the same order on
  every copy. The request is acknowledged once no backup of the extent is marked failed
  (:meth:`Replication.settle`).

A backup that fails (refused, reset, silent for the dead-peer time, or an error answer
other than NotPrimary) is marked failed and gets nothing more; requests wait, outside
every lock the controller's next ``ConfigureReplicas`` needs, until a new view drops
it (or copies it again) or :data:`REPLICA_TIMEOUT` passes (:class:`ReplicaTimeout`,
the dedup entry keeps what was applied so that a retry resumes). A backup answering
NotPrimary has a newer view than this primary: this one was deposed, and its client is
told NotPrimary (:class:`Deposed`: what the request applied here stays to be resumed).
The controller learns of failed backups from this server's heartbeats
(:meth:`Replication.failed_backups`; :attr:`Replication.on_failure` asks for a
heartbeat at once), so that a backup this primary cannot reach while its own server still
heartbeats (a partition between two memory servers) is dropped too.

A backup marked ``sync`` is added to the forwarding set first, then copied chunk by
chunk (:data:`SYNC_CHUNK`), each chunk under the extent's lock as the forwarding is: a
piece forwarded into a range not copied yet is overwritten by the copy that already
holds it, a piece after a chunk's copy lands after it on both copies. Last, under the
lock, the primary hands the copy its exactly-once entries for the extent (``SEED``): the
requests it applied before the copy joined reached the copy as bytes, not as pieces, and
a retry of one that reaches the copy after a promotion must be answered, not applied.

An unreplicated extent becomes a primary when the controller moves it to another
server (its new copy is synced as above, then promoted, and the old one released).
Mutations served the unreplicated way (straight into the mapping, no forwarding) are
counted while they run (:meth:`Replication.unreplicated`): the configuration that
makes the extent a primary first has the planes revoke the write access they handed
out (:attr:`Replication.revoke_direct`: the rdma plane's writable registration) and
waits for those mutations to end, so the copy that starts next misses none of them
(and a numbered one's exactly-once entry is finished before its count ends, so the
copy's handed-over entries answer its retry at the new place instead of applying it
again); those that come later see the role and take the primary's path (or, for collective
chunks, are refused with NotPrimary: their clients retry after the move). Waiting
requests (locks, collective chunks) are not counted while they wait.

One :class:`Replication` per memory server (built by its :class:`~.node.Node`), shared
by the servicer and the planes; the request paths of a primary and a backup are
:mod:`.replica_ops`'. Connections to a backup server are pooled per endpoint (:class:`Forwarder`),
:class:`smb_client.transports.tcp.TcpConnection` underneath (TLS to ``tcp+tls://``
endpoints with the server's own certificate, key and CA).

"""
from __future__ import annotations

import logging
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smb_client.transports.pool import ConnectionPool
from smb_client.transports.tcp import DEAD_PEER_TIMEOUT, TcpConnection
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import InvalidArgument, NotPrimary, ServerBusy, ServerUnavailable, SMBError
from smb_protocol.replicas import CONFIGURABLE, ReplicaRole
from smb_protocol.tickets import Ticket, TicketMode, sign
from smb_protocol.tls import TLS_SCHEME
from smb_protocol.wire import Op

__all__ = ["DEAD_PEER_TIMEOUT", "Backup", "FailedBackup", "Forwarder", "REPLICA_TIMEOUT", "REPLICATED_OPS",
           "RANGED_OPS", "ReplicaConfig", "ReplicaTimeout", "Replication"]

from smb_protocol.requests import Request, Seed, Write

from .arena import Extent
from .dedup import DedupTable, pack_records

log = logging.getLogger(__name__)

REPLICA_TIMEOUT = 30.0    # seconds a mutation waits for a failed backup to be dropped
SYNC_CHUNK = 4 << 20      # bytes copied to a syncing backup per hold of the extent's lock
SEED_BYTES = 1 << 20      # bytes of exactly-once entries per SEED message
FORWARD_TIMEOUT = 60.0    # seconds a forwarded piece may wait for its answer from a live backup
CONNECTIONS = 4           # pooled connections per backup server
TICKET_TTL = 3600.0       # seconds a replica ticket is valid; signed again at half of it
_WORD = struct.Struct("<q")
#: payload ops and SCALE are forwarded in pieces with the request's range in arg0/arg1
RANGED_OPS = frozenset({Op.WRITE, Op.ACCUMULATE, Op.AXPY, Op.SCALE})
#: operations a replicated extent serves (PUSH/PULL: collectives use unreplicated regions)
REPLICATED_OPS = RANGED_OPS | {Op.FETCH_ADD, Op.COMPARE_SWAP, Op.LOCK, Op.UNLOCK}


class Deposed(NotPrimary):
    """NotPrimary from a copy that is no longer its slot's primary: its configuration
    says so, or one of its backups has a newer view and refused its piece. ``resumable``:
    a request it applied part of stays interrupted in its exactly-once table (not
    finished with this error), so that the client's retry resumes it wherever the
    applied part is: at this copy when it stays the primary of a newer view (a sync
    driven again), at a copy synced from it (its entries go along), or, when it stays as
    a backup (a role swap), through the rest of the request that the new primary
    forwards here, applied instead of answered as a repeat."""

    resumable = True


class ReplicaTimeout(ServerUnavailable):
    """A backup failed and was not dropped by the controller in time. ``resumable``:
    the dedup entry keeps what was applied, so a retry resumes instead of failing again."""

    resumable = True


@dataclass(eq=False)
class Backup:
    """One backup of a primary extent: ``state`` syncing | live | failed."""
    extent_id: int
    server_id: str
    endpoint: str
    state: str = "live"
    reason: str = ""


@dataclass(frozen=True)
class FailedBackup:
    """A backup a primary marked failed and still has in its replica set (what the
    heartbeat reports to the controller)."""
    primary_extent_id: int
    backup_extent_id: int
    view: int
    reason: str


@dataclass(eq=False)
class ReplicaConfig:
    role: ReplicaRole = ReplicaRole.NONE
    view: int = 0
    backups: tuple[Backup, ...] = ()
    tickets: dict[int, tuple[str, float]] = field(default_factory=dict)  # backup extent -> (ticket, renew at)


class Forwarder:
    """Pooled connections to one backup server's tcp plane (``endpoint``)."""

    def __init__(self, endpoint: str, tls: ssl.SSLContext | None,
                 dead_peer_timeout: float = DEAD_PEER_TIMEOUT) -> None:
        ep = parse_endpoint(endpoint)
        self.endpoint = endpoint
        context = tls if ep.scheme == TLS_SCHEME else None
        if ep.scheme == TLS_SCHEME and context is None:
            raise InvalidArgument(f"backup {endpoint} serves TLS but this server has no tls_* settings")
        self.pool: ConnectionPool[TcpConnection] = ConnectionPool(
            lambda: TcpConnection(ep.host, ep.port, FORWARD_TIMEOUT, dead_peer_timeout, 0, context),
            CONNECTIONS, name=f"replica {endpoint}")

    def send(self, ticket: str, extent_id: int, piece: Request, payload: Sequence[memoryview] = ()) -> bytes:
        """Send ``piece`` to the backup's extent ``extent_id`` under ``ticket``; its answer body."""
        with self.pool.borrow() as conn:
            conn.present(ticket)
            # the typed piece as it is, with the original client's number
            return conn.request(piece.aimed(extent_id), payload)

    def close(self) -> None:
        self.pool.close()


class Replication:
    """The replica configuration of every extent of one arena, and the forwarders.

    Thread-safe. The configuration lives under its own condition, so that requests
    waiting for a failed backup to be dropped hold nothing that :meth:`configure`
    needs; :meth:`configure` also takes the extent's lock for the moment it changes the
    view, which a piece holds while it is forwarded (lock order: configuring lock,
    extent lock, condition).
    """

    def __init__(self, secret: bytes = b"", tls: ssl.SSLContext | None = None,
                 timeout: float = REPLICA_TIMEOUT, dead_peer_timeout: float = DEAD_PEER_TIMEOUT,
                 dedup: DedupTable | None = None) -> None:
        self.secret = secret
        self.tls = tls
        self.timeout = timeout
        self.dead_peer_timeout = dead_peer_timeout   # for forwarders made from now on
        self.dedup = dedup   # the server's exactly-once table: a sync hands a new copy its entries
        self._configs: dict[int, ReplicaConfig] = {}
        self._cond = threading.Condition()
        self._forwarders: dict[str, Forwarder] = {}
        self._configuring: dict[int, threading.Lock] = {}
        self._unreplicated: dict[int, int] = {}   # extent id -> mutations served unreplicated now
        #: called with an extent that stops taking direct writes (it became a primary or a
        #: backup), before its copy starts: a plane that handed out write access revokes it
        self.revoke_direct: list[Callable[[Extent], None]] = []
        self.counts = dict.fromkeys(("pieces", "bytes", "sync_bytes", "failures"), 0)
        #: called (no lock held) when a backup is newly marked failed: the server sends
        #: a heartbeat at once, so that the controller drops it within about a second
        self.on_failure: Callable[[], None] | None = None

    # -- lookups (no lock: one dict read) --------------------------------------------
    def config(self, extent_id: int) -> ReplicaConfig | None:
        return self._configs.get(extent_id)

    def role(self, extent_id: int) -> ReplicaRole:
        cfg = self._configs.get(extent_id)
        return cfg.role if cfg is not None else ReplicaRole.NONE

    def unreplicated(self, extent_id: int) -> _Unreplicated:
        """Serve one mutation of an unreplicated extent (a ``with`` block), counted while
        it runs (module docstring); NotPrimary once the extent has a role (a move began:
        the client opens the region again and sends it the way the region says)."""
        return _Unreplicated(self, extent_id)

    @staticmethod
    def moved(extent_id: int) -> NotPrimary:
        """The error of a mutation served the unreplicated way once the extent has a role."""
        return NotPrimary(f"extent {extent_id} is being moved or is replicated: its mutations "
                          "go to its primary's tcp data plane; open the region again")

    def _begin_unreplicated(self, extent_id: int) -> None:
        with self._cond:
            if self.role(extent_id):
                raise self.moved(extent_id)
            self._unreplicated[extent_id] = self._unreplicated.get(extent_id, 0) + 1

    def _end_unreplicated(self, extent_id: int) -> None:
        with self._cond:
            left = self._unreplicated[extent_id] - 1
            if left:
                self._unreplicated[extent_id] = left
            else:
                del self._unreplicated[extent_id]
                self._cond.notify_all()

    def _drain_unreplicated(self, extent_id: int, timeout: float) -> None:
        """Wait until no mutation served the unreplicated way runs on the extent;
        ServerBusy after ``timeout`` seconds (the controller configures it again)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._unreplicated.get(extent_id):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerBusy(f"extent {extent_id}: {self._unreplicated[extent_id]} mutation(s) "
                                     f"still running unreplicated after {timeout:g} s; configure again")
                self._cond.wait(left)

    def failed_backups(self) -> list[FailedBackup]:
        """Every backup of a primary extent here that is marked failed (waiting for the
        controller to drop it or copy it again), with the primary's view."""
        with self._cond:
            return [FailedBackup(extent_id, b.extent_id, cfg.view, b.reason)
                    for extent_id, cfg in self._configs.items() if cfg.role is ReplicaRole.PRIMARY
                    for b in cfg.backups if b.state == "failed"]

    def count(self, **counts: int) -> None:
        with self._cond:
            for name, n in counts.items():
                self.counts[name] += n

    # -- the controller's calls -------------------------------------------------------
    def configure(self, extent: Extent, view: int, role: ReplicaRole | str,
                  targets: Sequence[tuple[int, str, str, bool]]) -> tuple[int, int]:
        """Set ``extent``'s role at ``view``; ``targets``: (extent id, server id,
        tcp endpoint, sync) of each backup (primary only). Returns (view in force, bytes
        copied to syncing backups). An older view is refused (InvalidArgument); the same
        view changes nothing but copies again backups that are not live. A sync that
        fails marks the backup failed and raises ServerUnavailable.

        A primary configured a backup at a newer view (a graceful handover) is drained
        when this returns: the change waits for the piece being forwarded under the
        extent's lock, and the mutations after it are refused (NotPrimary), so every
        backup it had live holds what it applied. When one of its backups was not live
        (failed: it missed a piece), the change holds and the call raises
        ServerUnavailable naming it, so that the controller copies the staying copies
        again instead of trusting them (a repeat of the call succeeds)."""
        if role not in CONFIGURABLE:
            raise InvalidArgument(f"unknown replica role {role!r}: expected primary, backup or ''")
        role = ReplicaRole(role)
        if role and view < 1:
            raise InvalidArgument(f"a replicated extent's view starts at 1, not {view}")
        if role is not ReplicaRole.PRIMARY and targets:
            raise InvalidArgument(f"a {role or 'unreplicated'} extent has no backups")
        with self._cond:
            lock = self._configuring.setdefault(extent.extent_id, threading.Lock())
        with lock:
            # under the extent's lock too: a piece being forwarded under the old view is
            # answered before the new one is in force (the controller configures the
            # backups next, and they would refuse it as a deposed primary's: the piece,
            # applied here, would then be missing there)
            with extent.lock, self._cond:
                old = self._configs.get(extent.extent_id) or ReplicaConfig()
                if view < old.view:
                    raise InvalidArgument(f"extent {extent.extent_id}: view {view} is older than "
                                          f"its view {old.view}")
                # a primary made a backup (a graceful handover): drained here, under the
                # extent's lock; a backup it had not in step missed mutations
                behind = [b for b in old.backups if b.state != "live"] \
                    if old.role is ReplicaRole.PRIMARY and role is ReplicaRole.BACKUP and view > old.view else []
                if view == old.view and role == old.role and old.view:
                    backups = old.backups
                    cfg = old
                    for b in backups:
                        if b.state != "live":
                            b.state = "syncing"
                else:
                    backups = tuple(self._backup(old, *t) for t in targets)
                    cfg = ReplicaConfig(role, view, backups)
                    self._configs[extent.extent_id] = cfg
                    self._cond.notify_all()
                    extent.direct_writes(role is ReplicaRole.NONE)
                for b in backups:
                    self._forwarder(b.endpoint)
            log.info("extent %d: %s at view %d%s", extent.extent_id, role or "unreplicated", view,
                     "".join(f", backup {b.extent_id} on {b.server_id} ({b.state})" for b in backups))
            if role and not old.role:
                for revoke in list(self.revoke_direct):
                    revoke(extent)
            if role:
                self._drain_unreplicated(extent.extent_id, self.timeout)
                if not extent.native.block(self.timeout):   # the native loop's (blocked with direct_writes)
                    raise ServerBusy(f"extent {extent.extent_id}: a native request still ran after "
                                     f"{self.timeout:g} s; configure again")
            synced = sum(self._sync(extent, cfg, b) for b in backups if b.state == "syncing")
        if behind:
            raise ServerUnavailable(
                f"extent {extent.extent_id} is a backup at view {view} now, but as the primary it had "
                + ", ".join(f"backup {b.extent_id} on {b.server_id} {b.state}" + (f" ({b.reason})" if b.reason else "")
                            for b in behind)
                + ": that copy missed mutations; copy it again from the new primary")
        return view, synced

    def _backup(self, old: ReplicaConfig, extent_id: int, server_id: str, endpoint: str,
                sync: bool) -> Backup:
        """A backup of a new view: a live one of the old view stays live; a new one is
        trusted unless marked sync; one that failed or was syncing is copied again."""
        before = next((b for b in old.backups if (b.extent_id, b.server_id) == (extent_id, server_id)), None)
        stale = before is not None and before.state != "live"
        return Backup(extent_id, server_id, endpoint, "syncing" if sync or stale else "live")

    def _forwarder(self, endpoint: str) -> Forwarder:
        """Under ``_cond``."""
        fwd = self._forwarders.get(endpoint)
        if fwd is None:
            fwd = self._forwarders[endpoint] = Forwarder(endpoint, self.tls, self.dead_peer_timeout)
        return fwd

    def _sync(self, extent: Extent, cfg: ReplicaConfig, backup: Backup) -> int:
        """Copy ``extent`` to a backup already in the forwarding set, one chunk per hold
        of the extent's lock; returns the bytes copied.

        The backup first drops its exactly-once entries for the extent: a copy synced
        again may hold entries of pieces an earlier primary forwarded (a request this
        primary never applied), and would take this primary's piece of the client's
        retry for a repeat and skip it. Pieces forwarded before the drop are in the
        chunks copied after it; this primary's own entries follow the last chunk."""
        copied = 0
        with extent.pin():
            with extent.lock:
                if backup.state == "syncing" and self.dedup is not None:
                    try:
                        self._send(extent, cfg, backup, Seed(Op.SEED, forget=True), [])
                    except SMBError as exc:
                        self._fail(extent, backup, exc)
                        raise ServerUnavailable(f"extent {extent.extent_id}: starting its copy to backup "
                                                f"{backup.extent_id} on {backup.endpoint} failed: {exc}") from None
            for pos in range(0, extent.length, SYNC_CHUNK):
                n = min(SYNC_CHUNK, extent.length - pos)
                with extent.lock:
                    if backup.state != "syncing":
                        break
                    try:
                        self._send(extent, cfg, backup, Write(Op.WRITE, offset=pos, length=n),
                                   [extent.data[pos:pos + n]])
                    except SMBError as exc:
                        self._fail(extent, backup, exc)
                        raise ServerUnavailable(f"extent {extent.extent_id}: copying it to backup "
                                                f"{backup.extent_id} on {backup.endpoint} failed: {exc}") from None
                copied += n
            with extent.lock:
                if backup.state == "syncing":
                    self._seed(extent, cfg, backup)
        with self._cond:
            if backup.state == "syncing":
                backup.state = "live"
                self._cond.notify_all()
        self.count(sync_bytes=copied)
        log.info("extent %d: %d bytes copied to backup %d on %s", extent.extent_id, copied,
                 backup.extent_id, backup.endpoint)
        return copied

    def _seed(self, extent: Extent, cfg: ReplicaConfig, backup: Backup) -> None:
        """Hand a backup just filled the exactly-once entries of requests on the extent
        (the caller holds its lock, so none applies meanwhile; later ones reach the
        backup as pieces)."""
        if self.dedup is None:
            return
        records = self.dedup.export(extent.extent_id)
        for payload in pack_records(records, SEED_BYTES):
            try:
                self._send(extent, cfg, backup, Seed(Op.SEED, length=len(payload)), [memoryview(payload)])
            except SMBError as exc:
                self._fail(extent, backup, exc)
                raise ServerUnavailable(f"extent {extent.extent_id}: handing its exactly-once entries to "
                                        f"backup {backup.extent_id} on {backup.endpoint} failed: {exc}") from None
        if records:
            log.info("extent %d: %d exactly-once entries handed to backup %d", extent.extent_id,
                     len(records), backup.extent_id)

    def admit_piece(self, ticket: Ticket, extent_id: int) -> None:
        """Check a replica ticket's view for a piece on ``extent_id``: a newer view than
        the extent's makes it a backup of that view (a primary configured before its
        backups, or a deposed primary that a new one copies into); the same view is
        accepted on a backup; an older one (a deposed primary) is NotPrimary."""
        with self._cond:
            cfg = self._configs.get(extent_id) or ReplicaConfig()
            if ticket.view > cfg.view:
                log.info("extent %d: backup at view %d (a primary forwards to it)", extent_id, ticket.view)
                self._configs[extent_id] = ReplicaConfig(ReplicaRole.BACKUP, ticket.view)
                self._cond.notify_all()
            elif ticket.view < cfg.view or cfg.role is not ReplicaRole.BACKUP:
                raise NotPrimary(f"extent {extent_id} is {cfg.role or 'unreplicated'} at view {cfg.view}: "
                                 f"a forward of view {ticket.view} comes from a deposed primary")

    # -- the primary's path ---------------------------------------------------------
    def forward(self, extent: Extent, cfg: ReplicaConfig, piece: Request,
                payload: Sequence[memoryview] = ()) -> None:
        """Send one piece (a request with the extent's range it changed, see
        :mod:`.requests`) to every backup of ``cfg`` not marked failed and wait for the
        answers; the caller holds the extent's lock. A failing backup is marked failed
        (:meth:`settle` waits for it to be dropped); NotPrimary from a backup (this
        primary was deposed) raises :class:`Deposed`."""
        sent = 0
        for backup in cfg.backups:
            if backup.state == "failed":
                continue
            sent += 1
            try:
                self._send(extent, cfg, backup, piece, payload)
            except NotPrimary:
                raise Deposed(f"extent {extent.extent_id}: backup {backup.extent_id} on "
                                 f"{backup.endpoint} has a newer view: this copy is no longer "
                                 "the primary; open the region again") from None
            except SMBError as exc:
                self._fail(extent, backup, exc)
        n = sum(len(p) for p in payload)
        self.count(pieces=sent, bytes=n * sent)

    def _send(self, extent: Extent, cfg: ReplicaConfig, backup: Backup, piece: Request,
              payload: Sequence[memoryview]) -> None:
        with self._cond:
            fwd = self._forwarder(backup.endpoint)
            token, renew = cfg.tickets.get(backup.extent_id, ("", 0.0))
            if time.monotonic() >= renew:
                token = sign(self.secret, extent.region_uid, [backup.extent_id], TicketMode.REPLICA,
                             ttl=TICKET_TTL, view=cfg.view)[0]
                cfg.tickets[backup.extent_id] = (token, time.monotonic() + TICKET_TTL / 2)
        fwd.send(token, backup.extent_id, piece, payload)

    def _fail(self, extent: Extent, backup: Backup, exc: BaseException) -> None:
        with self._cond:
            if backup.state == "failed":
                return
            backup.state, backup.reason = "failed", str(exc)
            self.counts["failures"] += 1
            self._cond.notify_all()
        log.warning("extent %d: backup %d on %s failed (%s); mutations wait until the controller "
                    "drops it (reported with the next heartbeat, sent now)", extent.extent_id,
                    backup.extent_id, backup.endpoint, exc)
        tell = self.on_failure
        if tell is not None:
            try:
                tell()
            except Exception:   # never fail the request path for a heartbeat's sake
                log.exception("asking for a heartbeat after a failed backup")

    def settle(self, extent_id: int) -> None:
        """Block until no backup of the extent is marked failed (the controller dropped
        or re-copied it): then every live backup has what this primary applied. Raises
        NotPrimary when the extent stopped being a primary meanwhile,
        :class:`ReplicaTimeout` after :attr:`timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                cfg = self._configs.get(extent_id)
                if cfg is None or cfg.role is not ReplicaRole.PRIMARY:
                    raise NotPrimary(f"extent {extent_id} is no longer the primary of its replica set; "
                                     "open the region again")
                failed = [b for b in cfg.backups if b.state == "failed"]
                if not failed:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReplicaTimeout(
                        f"extent {extent_id}: backup {failed[0].extent_id} on {failed[0].endpoint} failed "
                        f"({failed[0].reason}) and the controller did not drop it within "
                        f"{self.timeout:g} s; the request is applied here, retry it")
                self._cond.wait(left)

    # -- lifecycle --------------------------------------------------------------------
    def extent_added(self, extent: Extent) -> None:
        pass

    def extent_retiring(self, extent: Extent) -> None:
        with self._cond:
            self._configs.pop(extent.extent_id, None)
            self._configuring.pop(extent.extent_id, None)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            forwarders = list(self._forwarders.values())
            self._forwarders.clear()
        for fwd in forwarders:
            fwd.close()


class _Unreplicated:
    """One mutation served unreplicated (:meth:`Replication.unreplicated`); a plain class,
    as every collective chunk enters it twice."""

    __slots__ = ("replication", "extent_id")

    def __init__(self, replication: Replication, extent_id: int) -> None:
        self.replication = replication
        self.extent_id = extent_id

    def __enter__(self) -> None:
        self.replication._begin_unreplicated(self.extent_id)

    def __exit__(self, *exc: object) -> None:
        self.replication._end_unreplicated(self.extent_id)
