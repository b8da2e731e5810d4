"""The controller's durable state in etcd (v3): the same methods and rules as the SQLite
:class:`.state.ControllerState`, for a control plane that outlives its machine.

Keys under the store's prefix ``P`` (default ``/smb``), values JSON:

- ``P/servers/<server_id>``: one memory server (the columns of SQLite's ``servers``);
- ``P/regions/<name>``: one region with its extents, by (slot, copy): each
  ``[extent_id, slot, server_id, length, copy, role, view]`` (rows written before
  replication have the first four; the rest default to an unreplicated extent), and
  ``replicas`` (absent: 1);
- ``P/placed/<server_id>/<extent_id>``: an index of the extents placed on a server (its
  region's uid and name, its length), written and removed with the region, so that a
  heartbeat reads the server's own extents and not every region;
- ``P/lost/<extent_id>``: an extent its server registered without;
- ``P/next_extent_id``: the next extent id to hand out; ids are never reused (the first
  is drawn at random in [2^61, 2^62), so that a new store does not hand out the ids of
  orphans a former one left on the servers);
- ``P/done_deletes/<unix seconds, 12 digits>/<request_id>``: a done delete (the region's
  name), kept ``DELETE_MEMORY_SECONDS`` for its retries; time first, so that the old
  ones go with one range delete;
- ``P/epoch`` and ``P/leader``: the leader election (:mod:`.leader`).

Every change that SQLite makes in one transaction is one etcd transaction here. Each
method reads what it decides on, then commits with compares: the keys it rewrites are
unchanged since the read (``mod_revision``), the keys it creates are absent, and, once
this controller leads, the leader epoch is still its own (its fence). A change that
loses a race is decided again from a fresh read; a change refused by the fence raises
``ControllerUnavailable`` naming the leader, and nothing of it is applied.

Nothing is cached: every call reads etcd, so a standby that takes over starts from
exactly what the previous leader committed. Thread safety: one lock serializes this
process's region changes; server rows (registrations, heartbeats, leases, drains) are
changed under their compares alone, so that heartbeats never queue behind region changes.

The module is longer than 400 lines on purpose, for the reason :mod:`.state` is: every
durable change is one method and one transaction here, side by side with the SQLite
backend's, so that a reader can check the two keep the same rules.
"""
from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from smb_protocol import errors
from smb_protocol import placement as placement_mod
from smb_protocol.names import check_region_name
from smb_protocol.placement import check_bytes
from smb_protocol.replicas import ReplicaRole

from . import etcd_kv as kv
from .records import (
    DELETE_MEMORY_SECONDS,
    ExtentRecord,
    HeldExtent,
    RegionRecord,
    ServerRecord,
    SlotChange,
    check_lease,
    check_replicas,
    check_request_id,
    check_slot_change,
    check_uid,
    find_orphans,
    initial_role,
    region_state,
)

log = logging.getLogger(__name__)

MAX_SERVERS = 1 << 16
FIRST_ID_BASE = 1 << 61  # a new store's first extent id is drawn in [2^61, 2^62)
MAX_TXN_OPS = 128        # etcd's default --max-txn-ops: operations (or compares) in one transaction
COMMIT_ATTEMPTS = 32   # fresh decisions after lost races before giving up

T = TypeVar("T")


@dataclass(frozen=True)
class Fence:
    """What a leader's every write checks: the epoch it won and its leader key."""

    epoch: int
    leader_revision: int  # create revision of the leader key it wrote


@dataclass
class _Snapshot:
    servers: dict[str, tuple[dict[str, Any], int]]   # id -> (row, mod revision)
    regions: dict[str, tuple[dict[str, Any], int]]   # name -> (row, mod revision)
    lost: set[int]
    extra: dict[str, kv.KeyValue | None] = field(default_factory=dict)  # single keys asked for


class EtcdState:
    """Servers, regions and extents in etcd; owns its etcd sessions.

    ``url``: ``etcd://host:port[,host:port...][/prefix]``. ``lease_seconds`` and
    ``orphan_grace_seconds`` as for :class:`.state.ControllerState`. ``recover``: remove
    regions left ``creating`` by a controller that died (only the leader may: a standby
    passes False and calls :meth:`take_over` once it leads).
    """

    def __init__(self, url: str, lease_seconds: float = 5.0, orphan_grace_seconds: float = 30.0,
                 recover: bool = True, timeout: float = kv.REQUEST_TIMEOUT) -> None:
        if lease_seconds <= 0:
            raise errors.InvalidArgument(f"lease must be positive, got {lease_seconds} seconds")
        if orphan_grace_seconds < 0:
            raise errors.InvalidArgument(f"orphan grace must not be negative, got {orphan_grace_seconds}")
        endpoints, self.prefix = kv.parse_url(url)
        self.path = url
        self.lease_seconds = float(lease_seconds)
        self.orphan_grace_seconds = float(orphan_grace_seconds)
        self.kv = kv.EtcdKV(endpoints, timeout)
        self._lock = threading.RLock()
        self.fence: Fence | None = None
        self.fenced = False   # True under an election: no write without a fence (a standby)
        self.describe_leader: Callable[[], str] = self._leader_in_store
        if recover:
            self.recover()

    # -- keys ----------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    @property
    def epoch_key(self) -> str:
        return self._key("epoch")

    @property
    def leader_key(self) -> str:
        return self._key("leader")

    @property
    def next_id_key(self) -> str:
        return self._key("next_extent_id")

    def _leader_in_store(self) -> str:
        """``at host:port (epoch N)`` of the leader the leader key names, for messages."""
        try:
            item = self.kv.get(self.leader_key)
        except errors.ControllerUnavailable:
            return "unknown (etcd unreachable)"
        if item is None:
            return "not elected yet; retry"
        row = item.json()
        return f"at {row['address']} (epoch {row['epoch']})"

    # -- plumbing ------------------------------------------------------------------------
    def close(self) -> None:
        """Close this thread's etcd sessions (idempotent)."""
        self.kv.close()

    def __enter__(self) -> EtcdState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _now(now: float | None) -> float:
        return time.time() if now is None else float(now)

    def _snapshot(self, region_prefix: str = "", servers: bool = True, regions: bool = True,
                  lost: bool = True, extra: Sequence[str] = ()) -> _Snapshot:
        """The parts asked for (and the single keys of ``extra``), read at one revision."""
        ops, kinds = [kv.get(key) for key in extra], ["extra"] * len(extra)
        for want, kind, op in ((servers, "servers", kv.get_prefix(self._key("servers", ""))),
                               (regions, "regions", kv.get_prefix(self._key("regions", region_prefix))),
                               (lost, "lost", kv.get_prefix(self._key("lost", "")))):
            if want:
                ops.append(op)
                kinds.append(kind)
        snap = _Snapshot({}, {}, set())
        for kind, kvs in zip(kinds, self.kv.read(*ops), strict=True):
            if kind == "extra":
                snap.extra[extra[len(snap.extra)]] = kvs[0] if kvs else None
            for item in kvs:
                if kind == "extra":
                    continue
                if kind == "servers":
                    row = item.json()
                    snap.servers[row["server_id"]] = (row, item.mod_revision)
                elif kind == "regions":
                    row = item.json()
                    snap.regions[row["name"]] = (row, item.mod_revision)
                else:
                    snap.lost.add(int(item.key.rpartition("/")[2]))
        return snap

    def _read_one(self, what: str, name: str) -> tuple[dict[str, Any] | None, int]:
        item = self.kv.get(self._key(what, name))
        return (None, 0) if item is None else (item.json(), item.mod_revision)

    def _commit(self, compare: list[kv.Op], ops: list[kv.Op]) -> bool:
        """Apply ``ops`` if ``compare`` and the fence hold; False on a lost race.

        Raises ControllerUnavailable when the fence fails (this controller no longer leads).
        """
        fence = self.fence
        if fence is None and self.fenced:
            raise errors.ControllerUnavailable(f"this controller stands by; the leader is "
                                               f"{self.describe_leader()}")
        checks = list(compare)
        if fence is not None:
            checks += [kv.value_is(self.epoch_key, str(fence.epoch)),
                       kv.create_revision_is(self.leader_key, fence.leader_revision)]
        result = self.kv.txn(checks, ops, [kv.get(self.epoch_key), kv.get(self.leader_key)])
        if result.succeeded:
            return True
        if fence is not None:
            epoch_kvs, leader_kvs = result.ranges
            epoch = int(epoch_kvs[0].value) if epoch_kvs else 0
            leader_rev = leader_kvs[0].create_revision if leader_kvs else 0
            if epoch != fence.epoch or leader_rev != fence.leader_revision:
                raise errors.ControllerUnavailable(
                    f"this controller no longer leads (its epoch {fence.epoch}, now {epoch}); "
                    f"nothing was changed; the leader is {self.describe_leader()}")
        return False

    def _commit_each(self, items: Iterable[tuple[list[kv.Op], list[kv.Op]]]) -> bool:
        """Commit independent (compares, ops) items, as many per transaction as etcd takes
        (``MAX_TXN_OPS``); False when one lost a race (others may be applied: the caller
        decides again from a fresh read, so each item must be safe to find done)."""
        done = True
        compare: list[kv.Op] = []
        ops: list[kv.Op] = []
        for c, o in items:
            if ops and (len(compare) + len(c) > MAX_TXN_OPS - 2 or len(ops) + len(o) > MAX_TXN_OPS):
                done = self._commit(compare, ops) and done
                compare, ops = [], []
            compare += c
            ops += o
        if ops:
            done = self._commit(compare, ops) and done
        return done

    def _retry(self, attempt: Callable[[], T | None], what: str, regions: bool = True) -> T:
        """Run ``attempt`` (which returns None after a lost race) until it decides.

        ``regions``: under the lock that serializes this process's region changes (a
        placement decides on every server's free bytes, which no compare covers). A
        change of one server's row alone passes False: its compare on that row is enough,
        and heartbeats must not wait behind a queue of region creates.
        """
        with self._lock if regions else contextlib.nullcontext():
            for _ in range(COMMIT_ATTEMPTS):
                result = attempt()
                if result is not None:
                    return result
        raise errors.ControllerUnavailable(f"{what}: etcd kept changing under this controller "
                                           f"({COMMIT_ATTEMPTS} attempts); retry")

    # -- leadership ----------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Remove regions left ``creating`` by a controller that died; returns their names.

        The extents their servers reserved become orphans the servers free after the grace.
        """
        def attempt() -> list[str] | None:
            snap = self._snapshot(servers=False, lost=False)
            stale = {n: rev for n, (row, rev) in snap.regions.items() if row["state"] == "creating"}
            if not self._commit_each(([kv.mod_revision_is(self._key("regions", n), rev)],
                                       self._removal(snap.regions[n][0])) for n, rev in stale.items()):
                return None
            return sorted(stale)
        stale = self._retry(attempt, "removing half-created regions")
        if stale:
            log.warning("removed %d region(s) left half-created by a previous controller: %s; "
                        "their extents are freed by the servers as orphans", len(stale), ", ".join(stale))
        return stale

    def take_over(self, fence: Fence, now: float | None = None) -> None:
        """Start leading with ``fence``: clean what a dead leader left half-done, and give
        every live server a full lease to find this controller.

        Region changes wait until it is done (it holds the region lock): a create begun
        now must not be taken for one the dead leader left half-done.
        """
        with self._lock:
            self.fence = fence
            self.recover()
            self._reindex()
        now = self._now(now)

        def attempt() -> bool | None:
            snap = self._snapshot(regions=False, lost=False)
            live = {sid: (row, rev) for sid, (row, rev) in snap.servers.items()
                    if row["state"] != "down" and row["last_heartbeat"] < now}
            return True if self._commit_each(
                ([kv.mod_revision_is(self._key("servers", sid), rev)],
                 [kv.put(self._key("servers", sid), json.dumps({**row, "last_heartbeat": now}))])
                for sid, (row, rev) in live.items()) else None
        self._retry(attempt, "taking over")
        log.info("leading with epoch %d", fence.epoch)

    def _reindex(self) -> None:
        """Make the ``placed`` index match the regions (a store written before the index,
        or by hand): add missing entries, drop entries of no region."""
        def attempt() -> bool | None:
            snap_regions, placed = self.kv.read(kv.get_prefix(self._key("regions", "")),
                                                kv.get_prefix(self._key("placed", "")))
            want = {self._key("placed", sid, eid): json.dumps({"uid": r["uid"], "name": r["name"],
                                                               "length": length})
                    for r in (item.json() for item in snap_regions)
                    for eid, _, sid, length, *_ in r["extents"]}
            have = {item.key: item for item in placed}
            ops = [kv.put(k, v) for k, v in want.items() if k not in have or have[k].value.decode() != v]
            ops += [kv.delete(k) for k in have if k not in want]
            if not ops:
                return True
            log.warning("repairing the placed-extent index: %d entr%s", len(ops), "y" if len(ops) == 1 else "ies")
            # no compares: only this leader writes (its fence is checked), under its lock
            return True if self._commit_each(([], [op]) for op in ops) else None
        self._retry(attempt, "repairing the placed-extent index")

    # -- servers -------------------------------------------------------------------------
    def register_server(self, server_id: str, host_id: str, grpc_address: str,
                        endpoints: Sequence[str], capacity: int,
                        held: Iterable[HeldExtent] = (), now: float | None = None
                        ) -> tuple[str, list[int]]:
        """Add or refresh a memory server; returns its id and the orphan extent ids (as
        :meth:`.state.ControllerState.register_server`)."""
        now = self._now(now)
        if not grpc_address:
            raise errors.InvalidArgument("a memory server must give its gRPC address")
        capacity = check_bytes("capacity", capacity)
        server_id = server_id or uuid.uuid4().hex[:12]
        held = list(held)
        held_ids = {h.extent_id for h in held}

        def attempt() -> tuple[str, list[int]] | None:
            snap = self._snapshot(lost=False)
            old = snap.servers.get(server_id)
            row = {"server_id": server_id, "host_id": host_id, "grpc_address": grpc_address,
                   "endpoints": list(endpoints), "capacity": int(capacity), "state": "up",
                   "drain": False, "last_heartbeat": now, "registered_at": now}
            if old is not None:
                row["drain"] = bool(old[0]["drain"])
                row["state"] = "draining" if row["drain"] else "up"
            known = self._known_extents(snap, server_id)
            lost = sorted(eid for eid, (_, state) in known.items() if state == "ready" and eid not in held_ids)
            key = self._key("servers", server_id)
            ops = [kv.put(key, json.dumps(row))] + [kv.put(self._key("lost", eid), "") for eid in lost]
            if not self._commit([kv.mod_revision_is(key, old[1] if old else 0)], ops):
                return None
            if old is None:
                log.info("server %s registered at %s (%d bytes)", server_id, grpc_address, capacity)
            else:
                log.info("server %s registered again at %s (%d bytes, %s)", server_id,
                         grpc_address, capacity, row["state"])
            if lost:
                log.warning("server %s does not hold %d extent(s) the controller placed on it "
                            "(restarted without persistence?); their regions are lost: %s",
                            server_id, len(lost), ", ".join(map(str, lost[:10])))
            return server_id, find_orphans(server_id, known, held, self.orphan_grace_seconds)
        return self._retry(attempt, f"registering server {server_id}", regions=False)

    def heartbeat(self, server_id: str, held: Iterable[HeldExtent] = (),
                  now: float | None = None) -> list[int]:
        """Renew a server's lease; returns its orphan extent ids. Raises ServerNotFound."""
        now = self._now(now)
        held = list(held)

        def attempt() -> list[int] | None:
            server, placed = self.kv.read(kv.get(self._key("servers", server_id)),
                                          kv.get_prefix(self._key("placed", server_id, "")))
            if not server:
                raise errors.ServerNotFound(f"no memory server {server_id!r} is registered; register first")
            row, rev = server[0].json(), server[0].mod_revision
            state = "draining" if row["drain"] else "up"
            if row["state"] == "down":
                log.info("server %s is back (%s)", server_id, state)
            key = self._key("servers", server_id)
            if not self._commit([kv.mod_revision_is(key, rev)],
                                [kv.put(key, json.dumps({**row, "state": state, "last_heartbeat": now}))]):
                return None
            known = {int(item.key.rpartition("/")[2]): (item.json()["uid"], "") for item in placed}
            return find_orphans(server_id, known, held, self.orphan_grace_seconds)
        return self._retry(attempt, f"heartbeat of server {server_id}", regions=False)

    @staticmethod
    def _known_extents(snap: _Snapshot, server_id: str) -> dict[int, tuple[str, str]]:
        """extent id -> (region uid, region state) of the extents placed on a server."""
        return {e[0]: (row["uid"], row["state"]) for row, _ in snap.regions.values()
                for e in row["extents"] if e[2] == server_id}

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Mark servers whose lease ran out ``down``; returns the ids newly marked."""
        cutoff = self._now(now) - self.lease_seconds

        def attempt() -> list[str] | None:
            snap = self._snapshot(regions=False, lost=False)
            late = {sid: (row, rev) for sid, (row, rev) in snap.servers.items()
                    if row["state"] != "down" and row["last_heartbeat"] < cutoff}
            if not self._commit_each(([kv.mod_revision_is(self._key("servers", sid), rev)],
                                      [kv.put(self._key("servers", sid), json.dumps({**row, "state": "down"}))])
                                     for sid, (row, rev) in late.items()):
                marked.update(late)  # some may be applied; the next read shows which are left
                return None
            return sorted(marked | set(late))
        marked: set[str] = set()
        ids = self._retry(attempt, "expiring leases", regions=False)
        for sid in ids:
            log.warning("server %s missed its lease (%.1f s): marked down", sid, self.lease_seconds)
        return ids

    def _update_server(self, server_id: str, change: Callable[[dict[str, Any]], dict[str, Any]],
                       missing: str) -> None:
        def attempt() -> bool | None:
            row, rev = self._read_one("servers", server_id)
            if row is None:
                raise errors.ServerNotFound(missing)
            key = self._key("servers", server_id)
            return True if self._commit([kv.mod_revision_is(key, rev)],
                                        [kv.put(key, json.dumps(change(row)))]) else None
        self._retry(attempt, f"updating server {server_id}", regions=False)

    def unregister(self, server_id: str, reason: str = "") -> ServerRecord:
        """A server stopping cleanly: mark it ``down`` now. Raises ServerNotFound."""
        self._update_server(server_id, lambda row: {**row, "state": "down"},
                            f"no memory server {server_id!r} is registered")
        log.info("server %s stopped%s: marked down", server_id, f" ({reason})" if reason else "")
        return self.get_server(server_id)

    def drain(self, server_id: str, undrain: bool = False) -> ServerRecord:
        """Stop (or resume) placing new extents on a server. Raises ServerNotFound."""
        def change(row: dict[str, Any]) -> dict[str, Any]:
            state = row["state"] if row["state"] == "down" else ("up" if undrain else "draining")
            return {**row, "drain": not undrain, "state": state}
        self._update_server(server_id, change,
                            f"no memory server {server_id!r}; see ListServers for the ids")
        log.info("server %s %s", server_id, "undrained" if undrain else "draining")
        return self.get_server(server_id)

    def get_server(self, server_id: str) -> ServerRecord:
        """One server; raises ServerNotFound."""
        for s in self.list_servers():
            if s.server_id == server_id:
                return s
        raise errors.ServerNotFound(f"no memory server {server_id!r}")

    def list_servers(self) -> list[ServerRecord]:
        """Every server ever registered, by id, with ``used`` computed from its extents."""
        return self._server_records(self._snapshot(lost=False))

    @staticmethod
    def _server_records(snap: _Snapshot) -> list[ServerRecord]:
        used = dict.fromkeys(snap.servers, 0)
        count = dict.fromkeys(snap.servers, 0)
        for row, _ in snap.regions.values():
            for _eid, _idx, sid, length, *_ in row["extents"]:
                used[sid] = used.get(sid, 0) + length
                count[sid] = count.get(sid, 0) + 1
        return [ServerRecord(sid, r["host_id"], r["grpc_address"], tuple(r["endpoints"]), r["capacity"],
                             used[sid], count[sid], r["state"], r["last_heartbeat"], r["registered_at"])
                for sid, (r, _) in sorted(snap.servers.items())]

    # -- regions -------------------------------------------------------------------------
    def begin_create_region(self, name: str, size: int, placement: str = "striped",
                            stripe_unit: int = 0, num_servers: int = 0,
                            segment_sizes: Sequence[int] = (), persistent: bool = False,
                            now: float | None = None, uid: str = "", replicas: int = 1,
                            server_weights: Mapping[str, float] | None = None
                            ) -> RegionRecord:
        """Plan a region and record it as ``creating`` (as
        :meth:`.state.ControllerState.begin_create_region`)."""
        now = self._now(now)
        uid = check_uid(uid)
        replicas = check_replicas(replicas)
        check_region_name(name)
        if size <= 0:
            raise errors.InvalidArgument(f"region size must be positive, got {size} bytes")
        size = check_bytes("region size", size, 1)
        stripe_unit = check_bytes("stripe unit", stripe_unit)
        segment_sizes = [check_bytes("a segment size", s) for s in segment_sizes]
        if not 0 <= int(num_servers) <= MAX_SERVERS:
            raise errors.InvalidArgument(f"num_servers must be 0 (all) to {MAX_SERVERS}, got {num_servers}")
        placement = placement or "striped"
        if placement != "layered" and segment_sizes:
            raise errors.InvalidArgument(f"segment sizes are only for layered placement, not {placement!r}")

        def attempt() -> RegionRecord | None:
            snap = self._snapshot(extra=(self.next_id_key,))
            existing = snap.regions.get(name)
            if existing is not None:
                what = " (being created)" if existing[0]["state"] == "creating" else ""
                raise errors.RegionExists(f"region {name!r} already exists{what}; open it, delete it, "
                                          "or pass exist_ok")
            if any(row["uid"] == uid for row, _ in snap.regions.values()):
                raise errors.InvalidArgument(f"uid {uid} already names another region; draw a new one")
            alive = now - self.lease_seconds
            up = [s for s in self._server_records(snap) if s.state == "up" and s.last_heartbeat >= alive]
            layout, copies = placement_mod.plan_replicated(
                int(size), placement, {s.server_id: s.free for s in up}, replicas,
                {s.server_id: s.host_id for s in up}, stripe_unit=int(stripe_unit),
                num_servers=int(num_servers), segment_sizes=[int(s) for s in segment_sizes], weights=server_weights)
            counter = snap.extra[self.next_id_key]
            first = int(counter.value) if counter is not None else FIRST_ID_BASE + secrets.randbits(61)
            extents: list[list[Any]] = []
            for idx, (length, sids) in enumerate(zip(layout.extent_lengths, copies, strict=True)):
                for copy, sid in enumerate(sids):
                    role, view = initial_role(replicas, copy)
                    extents.append([first + len(extents), idx, sid, length, copy, role, view])
            row: dict[str, Any] = {
                "name": name, "uid": uid, "size": layout.size, "placement": layout.kind,
                "stripe_unit": layout.stripe_unit, "segment_sizes": list(layout.segment_sizes),
                "segment_extents": list(layout.segment_extents), "persistent": bool(persistent),
                "created_at": now, "state": "creating", "replicas": replicas, "extents": extents}
            key = self._key("regions", name)
            compare = [kv.absent(key),
                       kv.mod_revision_is(self.next_id_key, counter.mod_revision if counter else 0)]
            ops = [kv.put(key, json.dumps(row)), kv.put(self.next_id_key, str(first + len(extents)))]
            ops += [kv.put(self._key("placed", sid, eid), json.dumps({"uid": row["uid"], "name": name,
                                                                       "length": length}))
                    for eid, _, sid, length, *_ in row["extents"]]
            if not self._commit(compare, ops):
                return None
            snap.regions[name] = (row, 0)
            return self._region(row, snap)
        region = self._retry(attempt, f"creating region {name}")
        log.info("planned region %s (%s, %d bytes) on %d extent(s)", name, region.placement,
                 region.size, len(region.extents))
        return region

    def _removal(self, row: dict[str, Any]) -> list[kv.Op]:
        """The ops that remove a region: its key and its extents' index keys."""
        return [kv.delete(self._key("regions", row["name"])), kv.delete(self._key("region_leases", row["name"]))] + [
            kv.delete(self._key("placed", sid, eid)) for eid, _, sid, *_ in row["extents"]]

    def commit_region(self, name: str, uid: str | None = None) -> RegionRecord:
        """Mark a ``creating`` region ``ready`` (idempotent); raises RegionNotFound."""
        def attempt() -> RegionRecord | None:
            snap = self._snapshot(region_prefix=name)
            row, rev = snap.regions.get(name, (None, 0))
            if row is None or (uid is not None and row["uid"] != uid):
                raise errors.RegionNotFound(f"region {name!r} was removed while it was being created")
            key = self._key("regions", name)
            row = {**row, "state": "ready"}
            if not self._commit([kv.mod_revision_is(key, rev)], [kv.put(key, json.dumps(row))]):
                return None
            return self._region(row, snap)
        region = self._retry(attempt, f"committing region {name}")
        log.info("region %s (uid %s) ready", name, region.uid)
        return region

    def abort_region(self, name: str, uid: str | None = None) -> list[ExtentRecord]:
        """Forget a region still ``creating``; returns its extents (``[]`` when none is)."""
        def attempt() -> list[ExtentRecord] | None:
            row, rev = self._read_one("regions", name)
            if row is None or row["state"] != "creating" or (uid is not None and row["uid"] != uid):
                return []
            if not self._commit([kv.mod_revision_is(self._key("regions", name), rev)], self._removal(row)):
                return None
            log.info("creation of region %s aborted", name)
            return list(self._region(row, self._snapshot(regions=False)).extents)
        return self._retry(attempt, f"aborting region {name}")

    def get_region(self, name: str) -> RegionRecord:
        """A ready region (state ``ready``, ``degraded`` or ``lost``); raises RegionNotFound."""
        snap = self._snapshot(region_prefix=name)
        found = snap.regions.get(name)
        if found is None or found[0]["state"] == "creating":
            raise errors.RegionNotFound(f"no region named {name!r}")
        return self._region(found[0], snap)

    def delete_region(self, name: str, request_id: str = "", now: float | None = None) -> list[ExtentRecord]:
        """Remove a ready region; returns its extents, which the caller releases (as
        :meth:`.state.ControllerState.delete_region`)."""
        request_id, now = check_request_id(request_id), self._now(now)
        done = self._key("done_deletes", "")

        def attempt() -> RegionRecord | None:
            snap = self._snapshot(region_prefix=name)
            found = snap.regions.get(name)
            if found is None or found[0]["state"] == "creating":
                raise errors.RegionNotFound(f"no region named {name!r}")
            row, rev = found
            ops = self._removal(row)
            ops += [kv.delete(self._key("lost", e[0])) for e in row["extents"] if e[0] in snap.lost]
            ops.append(kv.delete_range(done, done + f"{int(now - DELETE_MEMORY_SECONDS):012d}"))
            if request_id:
                ops.append(kv.put(done + f"{int(now):012d}/{request_id}", name))
            if not self._commit([kv.mod_revision_is(self._key("regions", name), rev)], ops):
                return None
            return self._region(row, snap)
        region = self._retry(attempt, f"deleting region {name}")
        log.info("region %s (uid %s) deleted", name, region.uid)
        return list(region.extents)

    # -- replica sets ----------------------------------------------------------------------
    def change_slot(self, name: str, uid: str, change: SlotChange
                    ) -> tuple[RegionRecord, list[ExtentRecord]] | None:
        """Apply one change of one slot of a replicated region in one transaction (as
        :meth:`.state.ControllerState.change_slot`): compares on the region's key and,
        for a new copy, on the extent id counter; writes the region, the ``placed`` index
        of added and removed copies and drops removed copies' ``lost`` keys."""
        def attempt() -> tuple[tuple[RegionRecord, list[ExtentRecord]] | None] | None:
            snap = self._snapshot(region_prefix=name, extra=(self.next_id_key,))
            found = snap.regions.get(name)
            if found is None or found[0]["uid"] != uid or found[0]["state"] == "creating":
                raise errors.RegionNotFound(f"no region named {name!r} (uid {uid})")
            row, rev = found
            region = self._region(row, snap)
            if region.view_of(change.index) != change.view:
                return (None,)
            check_slot_change(region, change, snap.servers)
            removed = [e for e in region.copies_of(change.index) if e.copy in change.remove]
            key = self._key("regions", name)
            compare = [kv.mod_revision_is(key, rev)]
            ops: list[kv.Op] = []
            extents: list[list[Any]] = []
            for eid, idx, sid, length, copy, role, view in (_extent_row(e) for e in row["extents"]):
                if idx == change.index:
                    if copy in change.remove:
                        ops.append(kv.delete(self._key("placed", sid, eid)))
                        ops.append(kv.delete(self._key("lost", eid)))
                        continue
                    role, view = change.roles.get(copy, role), change.view + 1
                extents.append([eid, idx, sid, length, copy, role, view])
            if change.add is not None:
                counter = snap.extra[self.next_id_key]
                eid = int(counter.value) if counter is not None else FIRST_ID_BASE + secrets.randbits(61)
                compare.append(kv.mod_revision_is(self.next_id_key, counter.mod_revision if counter else 0))
                length = region.copies_of(change.index)[0].length
                sid = change.add.server_id
                extents.append([eid, change.index, sid, length, change.add.copy, change.add.role,
                                change.view + 1])
                ops.append(kv.put(self.next_id_key, str(eid + 1)))
                ops.append(kv.put(self._key("placed", sid, eid),
                                  json.dumps({"uid": uid, "name": name, "length": length})))
            extents.sort(key=lambda e: (e[1], e[4]))
            new_row = {**row, "extents": extents}
            ops.append(kv.put(key, json.dumps(new_row)))
            if not self._commit(compare, ops):
                return None
            snap.lost -= {e.extent_id for e in removed}
            return ((self._region(new_row, snap), removed),)
        (result,) = self._retry(attempt, f"changing slot {change.index} of region {name}")
        if result is not None:
            log.info("region %s %s", name, change.describe())
        return result

    # -- owner leases (as :class:`.state.ControllerState`'s) --------------------------------
    def lease_region(self, name: str, owner: str, seconds: float, now: float | None = None) -> None:
        """Tie region ``name`` to ``owner``'s lease of ``seconds`` (one transaction)."""
        owner, seconds, now = check_lease(owner, seconds), float(seconds), self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> bool | None:
            row, rev = self._read_one("owner_leases", owner)
            lease = {"seconds": max(seconds, row["seconds"] if row else 0.0),
                     "expires": max(now + seconds, row["expires"] if row else 0.0)}
            compare = [kv.mod_revision_is(key, rev) if row else kv.absent(key)]
            ops = [kv.put(self._key("region_leases", name), owner), kv.put(key, json.dumps(lease))]
            return True if self._commit(compare, ops) else None
        self._retry(attempt, f"leasing region {name}", regions=False)

    def renew_lease(self, owner: str, now: float | None = None) -> int:
        """Renew ``owner``'s lease; how many regions it holds (0: none, or run out)."""
        now = self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> int | None:
            row, rev = self._read_one("owner_leases", owner)
            if row is None or row["expires"] < now:
                return 0
            (leases,) = self.kv.read(kv.get_prefix(self._key("region_leases", "")))
            held = sum(1 for item in leases if item.value.decode() == owner)
            lease = {**row, "expires": now + row["seconds"]}
            return held if self._commit([kv.mod_revision_is(key, rev)], [kv.put(key, json.dumps(lease))]) else None
        return self._retry(attempt, f"renewing the lease of {owner}", regions=False)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ready regions whose owner's lease ran out, by name; forgets owners that hold
        no region any more."""
        now = self._now(now)
        owners_prefix, leases_prefix = self._key("owner_leases", ""), self._key("region_leases", "")
        owners, leases, regions = self.kv.read(kv.get_prefix(owners_prefix), kv.get_prefix(leases_prefix),
                                               kv.get_prefix(self._key("regions", "")))
        expired = {item.key[len(owners_prefix):]: item.mod_revision for item in owners
                   if item.json()["expires"] < now}
        ready = {item.json()["name"] for item in regions if item.json()["state"] == "ready"}
        holding = {item.value.decode() for item in leases}
        idle = [(owner, rev) for owner, rev in expired.items() if owner not in holding]
        if idle:
            self._commit_each(([kv.mod_revision_is(self._key("owner_leases", o), rev)],
                               [kv.delete(self._key("owner_leases", o))]) for o, rev in idle)
        return sorted(item.key[len(leases_prefix):] for item in leases
                      if item.value.decode() in expired and item.key[len(leases_prefix):] in ready)

    def deleted_by(self, name: str, request_id: str) -> bool:
        """True when the delete of ``request_id`` removed region ``name`` lately (as
        :meth:`.state.ControllerState.deleted_by`)."""
        if not request_id:
            return False
        (kvs,) = self.kv.read(kv.get_prefix(self._key("done_deletes", "")))
        return any(item.key.endswith("/" + request_id) and item.value.decode() == name for item in kvs)

    def list_regions(self, prefix: str = "") -> list[RegionRecord]:
        """Ready regions whose name starts with ``prefix``, by name."""
        snap = self._snapshot(region_prefix=prefix)
        return [self._region(row, snap) for name, (row, _) in sorted(snap.regions.items())
                if row["state"] == "ready" and name.startswith(prefix)]

    @staticmethod
    def _region(row: dict[str, Any], snap: _Snapshot) -> RegionRecord:
        extents = []
        for eid, idx, sid, length, copy, role, view in (_extent_row(e) for e in row["extents"]):
            server = snap.servers.get(sid, ({}, 0))[0]
            extents.append(ExtentRecord(eid, idx, sid, length, server.get("grpc_address", ""),
                                        server.get("host_id", ""), tuple(server.get("endpoints", ())),
                                        server.get("state", ""), eid in snap.lost, copy, role, view))
        extents.sort(key=lambda e: (e.index, e.copy))
        replicas = int(row.get("replicas", 1))
        return RegionRecord(row["name"], row["uid"], row["size"], row["placement"], row["stripe_unit"],
                            tuple(row["segment_sizes"]), tuple(row["segment_extents"]),
                            bool(row["persistent"]), row["created_at"],
                            region_state(row["state"], extents, replicas), tuple(extents), replicas)


def _extent_row(e: Sequence[Any]) -> tuple[int, int, str, int, int, ReplicaRole, int]:
    """One stored extent as (id, slot, server, length, copy, role, view); rows written
    before replication hold the first four."""
    eid, idx, sid, length, *rest = e
    copy, role, view = (list(rest) + [0, "", 0][len(rest):])[:3]
    return int(eid), int(idx), str(sid), int(length), int(copy), ReplicaRole.parse(str(role)), int(view)
