"""Creating and deleting regions: the sequence between the state and the memory servers.

Create: plan the region in the state (``creating``), reserve every extent (every copy
of a replicated region) on its server in parallel, then commit. A replicated region's
replica sets are configured before the commit: backups first (role backup, view 1),
then primaries (role primary, view 1, their backups with ``sync`` off: fresh extents
are zeros on every copy). If any reservation or configuration fails, what was reserved
is released, the region is aborted, and one typed error names the server (``nothing
was created``).
With ``exist_ok``, a caller that finds the name being created by another caller waits
(on a condition, woken when that creation ends) and then gets the region it made.

Delete: remove the region from the state, then release its extents (best effort: an
extent a server does not free now becomes an orphan it frees after the grace period).

No gRPC here: memory servers are reached through :class:`.memservers.MemoryServers`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures

from smb_protocol import errors
from smb_protocol.replicas import ReplicaRole

from .memservers import Backup, MemoryServers
from .records import CreateRequest, ExtentRecord, RegionRecord
from .stores.protocol import StateStore

log = logging.getLogger(__name__)

EXIST_OK_WAIT = 30.0         # seconds create(exist_ok) waits for a concurrent create of the name
MEMSERVER_CALL_THREADS = 32  # parallel reserve/release calls, all regions together


class RegionCreator:
    """Borrows ``state`` and ``servers`` (the caller closes them); owns a thread pool
    for memory-server calls, shut down by :meth:`close`."""

    def __init__(self, state: StateStore, servers: MemoryServers,
                 threads: int = MEMSERVER_CALL_THREADS,
                 exist_ok_wait: float = EXIST_OK_WAIT) -> None:
        self.state = state
        self.servers = servers
        self.exist_ok_wait = exist_ok_wait
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix="memserver-call")
        self._cond = threading.Condition()
        self._creating: dict[str, str] = {}  # names this controller is creating now -> uid asked

    def close(self) -> None:
        """Wait for memory-server calls in flight; later calls fail."""
        self._pool.shutdown(wait=True)

    # -- create --------------------------------------------------------------------------
    def create(self, request: CreateRequest, exist_ok: bool = False) -> RegionRecord:
        """Create the region (or, with ``exist_ok``, return the existing one if it has
        the size and placement asked for). Raises typed errors; on any error nothing is
        created.

        With ``request.uid``, a create that finds the region it names made under that uid
        (an earlier attempt of the same call: its reply was lost to a failover or a
        timeout) returns that region instead of RegionExists.
        """
        deadline = time.monotonic() + self.exist_ok_wait
        while True:
            self._claim(request.name, exist_ok, deadline, request.uid)
            try:
                try:
                    region = self.state.begin_create_region(request)
                except errors.RegionExists:
                    if not exist_ok and not request.uid:
                        raise
                    try:
                        existing = self.state.get_region(request.name)
                    except errors.RegionNotFound:  # deleted meanwhile: try again
                        if time.monotonic() > deadline:
                            raise
                        continue
                    if request.uid and existing.uid == request.uid:
                        log.info("region %s: a repeated create of uid %s gets the region it made",
                                 request.name, request.uid)
                        return existing
                    if not exist_ok:
                        raise
                    check_same(existing, request)
                    return existing
                if request.lease_seconds:
                    try:
                        self.state.lease_region(request.name, request.owner, request.lease_seconds)
                    except BaseException:
                        self.state.abort_region(request.name, region.uid)
                        raise
                return self._reserve_and_commit(region)
            finally:
                self._unclaim(request.name)

    def _claim(self, name: str, exist_ok: bool, deadline: float, uid: str = "") -> None:
        """Mark ``name`` as being created here; with ``exist_ok`` first wait until no
        other caller is creating it; with ``uid``, wait for a create of that uid (an
        earlier attempt of the same call)."""
        with self._cond:
            if exist_ok or (uid and self._creating.get(name) == uid):
                if not self._cond.wait_for(lambda: name not in self._creating,
                                           max(0.0, deadline - time.monotonic())):
                    raise errors.RegionExists(
                        f"region {name!r} is still being created after {self.exist_ok_wait:g} s; "
                        "try again")
            elif name in self._creating:
                raise errors.RegionExists(f"region {name!r} already exists (being created); "
                                          "open it, delete it, or pass exist_ok")
            self._creating[name] = uid

    def _unclaim(self, name: str) -> None:
        with self._cond:
            self._creating.pop(name, None)
            self._cond.notify_all()

    def _reserve_and_commit(self, region: RegionRecord) -> RegionRecord:
        jobs = {self._pool.submit(self.servers.reserve, e.grpc_address, region.uid, e,
                                  region.persistent): e for e in region.extents}
        reserved: list[ExtentRecord] = []
        failed: list[tuple[ExtentRecord, errors.SMBError]] = []
        for job, extent in jobs.items():
            try:
                job.result()
                reserved.append(extent)
            except errors.SMBError as exc:
                failed.append((extent, exc))
            except Exception as exc:  # a bug; keep the cluster consistent anyway
                log.exception("reserving extent %d", extent.extent_id)
                failed.append((extent, errors.ServerError(str(exc))))
        if not failed and region.replicas > 1:
            failed = self._configure_new(region)
        if failed:
            self.release_all(region.uid, reserved)
            self.state.abort_region(region.name, region.uid)
            raise reserve_error(region.name, failed)
        try:
            return self.state.commit_region(region.name, region.uid)
        except errors.SMBError:
            self.release_all(region.uid, reserved)
            raise

    def _configure_new(self, region: RegionRecord) -> list[tuple[ExtentRecord, errors.SMBError]]:
        """Configure a new region's replica sets (backups, then primaries, each group in
        parallel); returns the failures."""
        backups = [e for e in region.extents if e.role == ReplicaRole.BACKUP]
        primaries = [(e, [Backup(b) for b in region.copies_of(e.index) if b.role == ReplicaRole.BACKUP])
                     for e in region.extents if e.role == ReplicaRole.PRIMARY]
        failed: list[tuple[ExtentRecord, errors.SMBError]] = []
        groups: list[list[tuple[ExtentRecord, ReplicaRole, list[Backup]]]] = [
            [(e, ReplicaRole.BACKUP, []) for e in backups], [(e, ReplicaRole.PRIMARY, bs) for e, bs in primaries]]
        for group in groups:
            jobs = {self._pool.submit(self.servers.configure_replicas, e.grpc_address, region.uid,
                                      e, e.view, role, targets): e for e, role, targets in group}
            for job, extent in jobs.items():
                try:
                    job.result()
                except errors.SMBError as exc:
                    failed.append((extent, exc))
                except Exception as exc:  # a bug; keep the cluster consistent anyway
                    log.exception("configuring extent %d", extent.extent_id)
                    failed.append((extent, errors.ServerError(str(exc))))
            if failed:
                break
        return failed

    # -- delete --------------------------------------------------------------------------
    def delete(self, name: str, request_id: str = "") -> None:
        """Remove the region, then release its extents; raises RegionNotFound, except for
        a repeat of a delete of ``request_id`` that was done (its reply was lost)."""
        try:
            region = self.state.get_region(name)
        except errors.RegionNotFound:
            done = self.state.deleted_by(name, request_id)
            if done is None:
                raise
            # a leader that died between the delete and the releases freed nothing: free
            # the extents now (a server that freed one already says so), so that handles
            # of the region stop reaching its memory at once, not at the orphan sweep
            log.info("region %s: a repeated delete (request %s) was done already; releasing its "
                     "%d extent(s) again", name, request_id, len(done.extents))
            self.release_all(done.uid, done.records())
            return
        extents = self.state.delete_region(name, request_id)
        self.release_all(region.uid, extents)

    def delete_expired(self) -> list[str]:
        """Delete the regions whose owner's lease ran out (the owner stopped renewing: it
        died or was cut off); returns their names."""
        gone = []
        for name in self.state.expired_leases():
            try:
                self.delete(name)
            except errors.RegionNotFound:
                continue
            log.warning("region %s deleted: its owner's lease ran out", name)
            gone.append(name)
        return gone

    def release_all(self, region_uid: str, extents: Sequence[ExtentRecord]) -> None:
        """Release extents in parallel, best effort: a server that is down or does not
        answer keeps its extent as an orphan, freed after its next heartbeat's grace."""
        jobs = {self._pool.submit(self.servers.release, e.grpc_address, region_uid, e): e
                for e in extents if e.server_state != "down"}
        for job, extent in jobs.items():
            try:
                job.result()
            except Exception as exc:
                log.warning("could not release extent %d on server %s (%s): %s; it will be freed "
                            "as an orphan", extent.extent_id, extent.server_id,
                            extent.grpc_address, exc)


def check_same(existing: RegionRecord, request: CreateRequest) -> None:
    """exist_ok returns an existing region only if it is the one asked for."""
    if request.size and request.size != existing.size:
        raise errors.RegionExists(f"region {existing.name!r} exists with {existing.size} bytes, "
                                  f"not {request.size}; delete it or use another name")
    if request.placement and request.placement != existing.placement:
        raise errors.RegionExists(f"region {existing.name!r} exists with {existing.placement} "
                                  f"placement, not {request.placement}")
    if request.replicas > 1 and request.replicas != existing.replicas:
        raise errors.RegionExists(f"region {existing.name!r} exists with {existing.replicas} "
                                  f"cop{'y' if existing.replicas == 1 else 'ies'} of every byte, "
                                  f"not {request.replicas}")


def reserve_error(name: str, failed: list[tuple[ExtentRecord, errors.SMBError]]) -> errors.SMBError:
    """One error for a failed create: out of memory first, unreachable servers as
    ServerUnavailable; the message names the server."""
    oom = [(e, x) for e, x in failed if isinstance(x, errors.OutOfMemory)]
    extent, exc = (oom or failed)[0]
    cls: type[errors.SMBError] = type(exc)
    if isinstance(exc, (errors.Unavailable, errors.Timeout)):
        cls = errors.ServerUnavailable
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return cls(f"memory server {extent.server_id} at {extent.grpc_address} could not reserve "
               f"{extent.length} bytes for region {name!r} (or set up its copy): {exc}{others}; "
               "nothing was created")
