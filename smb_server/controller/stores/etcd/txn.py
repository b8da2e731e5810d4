"""Reading and committing the controller's etcd state (:class:`.etcd.state.EtcdState`
builds on it): the store's keys, snapshots read at one revision and the records they
give, commits fenced by the leader epoch, and the retry of changes that lost a race.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from smb_protocol import errors
from smb_protocol.replicas import ReplicaRole

from ...moves import DRAIN_EVACUATE
from ...records import ExtentRecord, RegionRecord, ServerRecord, region_state
from . import kv

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128        # etcd's default --max-txn-ops: operations (or compares) in one transaction
COMMIT_ATTEMPTS = 32   # fresh decisions after lost races before giving up

T = TypeVar("T")
Q = TypeVar("Q")


class Pending(Generic[Q, T]):
    """One request of a :class:`GroupCommit` and, once decided, its answer."""

    def __init__(self, request: Q) -> None:
        self.request = request
        self.done = False
        self.wake = threading.Event()   # set when answered, or when it is its turn to write
        self._result: T | None = None
        self._error: BaseException | None = None

    def answer(self, result: T) -> None:
        self._result, self.done = result, True
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        self._error, self.done = error, True
        self.wake.set()

    def outcome(self) -> T:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class GroupCommit(Generic[Q, T]):
    """Requests that arrive while a batch is being written are written together, by the
    first of their callers, with ``write(batch)`` (which answers or fails every one of
    them): one read and one transaction for many, where one at a time would queue
    behind each other's round trips to etcd. Each waiting caller sleeps on an event of
    its own, so a batch wakes only its own callers and the next writer."""

    def __init__(self, write: Callable[[list[Pending[Q, T]]], None]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._queue: list[Pending[Q, T]] = []
        self._busy = False

    def run(self, request: Q) -> T:
        mine: Pending[Q, T] = Pending(request)
        with self._lock:
            self._queue.append(mine)
            writes, self._busy = not self._busy, True
        if not writes:
            mine.wake.wait()
            if mine.done:
                return mine.outcome()
        with self._lock:   # this caller's turn: it writes what queued, itself included
            batch, self._queue = self._queue, []
        try:
            self._write(batch)
        except BaseException as exc:
            for item in batch:
                if not item.done:
                    item.fail(exc)
        finally:
            with self._lock:
                if self._queue:
                    self._queue[0].wake.set()   # the next writer
                else:
                    self._busy = False
        return mine.outcome()


@dataclass(frozen=True)
class Fence:
    """What a leader's every write checks: the epoch it won and its leader key."""

    epoch: int
    leader_revision: int  # create revision of the leader key it wrote


@dataclass
class Snapshot:
    """Servers, regions and lost extents read at one revision (the parts asked for)."""

    servers: dict[str, tuple[dict[str, Any], int]]   # id -> (row, mod revision)
    regions: dict[str, tuple[dict[str, Any], int]]   # name -> (row, mod revision)
    lost: set[int]
    extra: dict[str, kv.KeyValue | None] = field(default_factory=dict)  # single keys asked for

    def known_extents(self, server_id: str) -> dict[int, tuple[str, str]]:
        """extent id -> (region uid, region state) of the extents placed on a server."""
        return {e[0]: (row["uid"], row["state"]) for row, _ in self.regions.values()
                for e in row["extents"] if e[2] == server_id}

    def server_records(self) -> list[ServerRecord]:
        """Every server, by id, with ``used`` computed from its extents."""
        used = dict.fromkeys(self.servers, 0)
        count = dict.fromkeys(self.servers, 0)
        for row, _ in self.regions.values():
            for _eid, _idx, sid, length, *_ in row["extents"]:
                used[sid] = used.get(sid, 0) + length
                count[sid] = count.get(sid, 0) + 1
        return [ServerRecord(sid, r["host_id"], r["grpc_address"], tuple(r["endpoints"]), r["capacity"],
                             used[sid], count[sid], r["state"], r["last_heartbeat"], r["registered_at"],
                             r["drain"] == DRAIN_EVACUATE)
                for sid, (r, _) in sorted(self.servers.items())]

    def region(self, row: dict[str, Any]) -> RegionRecord:
        """A stored region row as its record, its extents' servers from this snapshot."""
        extents = []
        for eid, idx, sid, length, copy, role, view in (_extent_row(e) for e in row["extents"]):
            server = self.servers.get(sid, ({}, 0))[0]
            extents.append(ExtentRecord(eid, idx, sid, length, server.get("grpc_address", ""),
                                        server.get("host_id", ""), tuple(server.get("endpoints", ())),
                                        server.get("state", ""), eid in self.lost, copy, role, view))
        extents.sort(key=lambda e: (e.index, e.copy))
        replicas = int(row.get("replicas", 1))
        return RegionRecord(row["name"], row["uid"], row["size"], row["placement"], row["stripe_unit"],
                            tuple(row["segment_sizes"]), tuple(row["segment_extents"]),
                            bool(row["persistent"]), row["created_at"],
                            region_state(row["state"], extents, replicas), tuple(extents), replicas)


class EtcdStore:
    """The etcd side of :class:`.etcd.state.EtcdState`: its keys, snapshots read at one
    revision, fenced commits and the retry of lost races; owns its etcd channel."""

    def __init__(self, url: str, timeout: float = kv.REQUEST_TIMEOUT) -> None:
        endpoints, self.prefix = kv.parse_url(url)
        self.path = url
        self.kv = kv.EtcdKV(endpoints, timeout)
        self._lock = threading.RLock()
        self.fence: Fence | None = None
        self.fenced = False   # True under an election: no write without a fence (a standby)
        self.describe_leader: Callable[[], str] = self._leader_in_store

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

    def _removal(self, row: dict[str, Any]) -> list[kv.Op]:
        """The ops that remove a region: its key and its extents' index keys."""
        return [kv.delete(self._key("regions", row["name"])), kv.delete(self._key("region_leases", row["name"]))] + [
            kv.delete(self._key("placed", sid, eid)) for eid, _, sid, *_ in row["extents"]]

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
        """Close the etcd channel (idempotent)."""
        self.kv.close()

    @staticmethod
    def _now(now: float | None) -> float:
        return time.time() if now is None else float(now)

    def _snapshot(self, region_prefix: str = "", servers: bool = True, regions: bool = True,
                  lost: bool = True, extra: Sequence[str] = ()) -> Snapshot:
        """The parts asked for (and the single keys of ``extra``), read at one revision."""
        ops, kinds = [kv.get(key) for key in extra], ["extra"] * len(extra)
        for want, kind, op in ((servers, "servers", kv.get_prefix(self._key("servers", ""))),
                               (regions, "regions", kv.get_prefix(self._key("regions", region_prefix))),
                               (lost, "lost", kv.get_prefix(self._key("lost", "")))):
            if want:
                ops.append(op)
                kinds.append(kind)
        snap = Snapshot({}, {}, set())
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

    def _commit(self, compare: list[kv.Cmp], ops: list[kv.Op]) -> int:
        """Apply ``ops`` if ``compare`` and the fence hold; returns the revision they were
        written at (the mod revision of every key they put), 0 on a lost race.

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
            return result.revision
        if fence is not None:
            epoch_kvs, leader_kvs = result.ranges
            epoch = int(epoch_kvs[0].value) if epoch_kvs else 0
            leader_rev = leader_kvs[0].create_revision if leader_kvs else 0
            if epoch != fence.epoch or leader_rev != fence.leader_revision:
                raise errors.ControllerUnavailable(
                    f"this controller no longer leads (its epoch {fence.epoch}, now {epoch}); "
                    f"nothing was changed; the leader is {self.describe_leader()}")
        return 0

    def _commit_each(self, items: Iterable[tuple[list[kv.Cmp], list[kv.Op]]]) -> bool:
        """Commit independent (compares, ops) items, as many per transaction as etcd takes
        (``MAX_TXN_OPS``); False when one lost a race (others may be applied: the caller
        decides again from a fresh read, so each item must be safe to find done)."""
        done = True
        compare: list[kv.Cmp] = []
        ops: list[kv.Op] = []
        for c, o in items:
            if ops and (len(compare) + len(c) > MAX_TXN_OPS - 2 or len(ops) + len(o) > MAX_TXN_OPS):
                done = bool(self._commit(compare, ops)) and done
                compare, ops = [], []
            compare += c
            ops += o
        if ops:
            done = bool(self._commit(compare, ops)) and done
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


def _extent_row(e: Sequence[Any]) -> tuple[int, int, str, int, int, ReplicaRole, int]:
    """One stored extent as (id, slot, server, length, copy, role, view); rows written
    before replication hold the first four."""
    eid, idx, sid, length, *rest = e
    copy, role, view = (list(rest) + [0, "", 0][len(rest):])[:3]
    return int(eid), int(idx), str(sid), int(length), int(copy), ReplicaRole.parse(str(role)), int(view)
