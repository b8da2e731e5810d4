"""Region creates on the etcd store (:class:`.etcd.state.EtcdState` builds on it):
planned in batches and written with one read and as few transactions as etcd takes.

A create waits behind the one being written; whatever queued meanwhile is planned
together on one snapshot (in order, each seeing the regions planned before it) and
written in one transaction (several if etcd's ``MAX_TXN_OPS`` is reached), each region
with a compare that its key is absent and all with one on the extent id counter. The
rules are those of a single create: the same checks, the same placement. Creates of a
transaction that lost a race are planned again from a fresh read.

A region written ``creating`` here is remembered (its row and the revision it was
written at) until its commit or abort, so that its commit is one transaction without a
read.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from smb_protocol import errors

from ...records import CreateRequest, RegionRecord, ServerRecord
from ...rules import check_new_region, plan_region
from . import kv
from .txn import COMMIT_ATTEMPTS, MAX_TXN_OPS, EtcdStore, GroupCommit, Pending, Snapshot

log = logging.getLogger(__name__)

FIRST_ID_BASE = 1 << 61  # a new store's first extent id is drawn in [2^61, 2^62)
BEGUN_MAX = 1024         # regions begun and not yet committed or aborted that are remembered


@dataclass(frozen=True)
class Begun:
    """A region this controller wrote ``creating``: its row, the revision it was written
    at, and its record."""

    row: dict[str, Any]
    revision: int
    region: RegionRecord


class BegunRegions:
    """Regions begun here, by name, until their commit or abort (thread-safe, bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Begun] = {}

    def remember(self, name: str, begun: Begun) -> None:
        with self._lock:
            if len(self._items) >= BEGUN_MAX:  # creators that never finished: forget them
                self._items.clear()
            self._items[name] = begun

    def pop(self, name: str) -> Begun | None:
        with self._lock:
            return self._items.pop(name, None)


Create = Pending[tuple[CreateRequest, float], RegionRecord]


@dataclass
class _Seen:
    """What one pass plans on, read once: the servers, the uids in use, and the bytes
    each server gave to the regions planned so far in the pass."""

    servers: list[ServerRecord]
    uids: set[str]
    taken: dict[str, int]


class RegionCreates(EtcdStore):
    """Batched region creates; ``lease_seconds`` is set by the subclass."""

    lease_seconds: float

    def __init__(self, url: str, timeout: float = kv.REQUEST_TIMEOUT) -> None:
        super().__init__(url, timeout)
        self._begun = BegunRegions()
        self._creates: GroupCommit[tuple[CreateRequest, float], RegionRecord] = GroupCommit(self._write_creates)

    def _plan(self, req: CreateRequest, now: float, snap: Snapshot, seen: _Seen, first: int) -> dict[str, Any]:
        """The row of a new region planned on ``snap`` (and ``seen``: what the plans of
        this pass took), its extent ids from ``first``."""
        existing = snap.regions.get(req.name)
        check_new_region(req, existing[0]["state"] if existing else None, req.uid in seen.uids)
        layout, planned = plan_region(req, seen.servers, now, self.lease_seconds, seen.taken)
        extents: list[list[Any]] = []
        for e in planned:
            extents.append([first + len(extents), e.index, e.server_id, e.length, e.copy, e.role, e.view])
            seen.taken[e.server_id] = seen.taken.get(e.server_id, 0) + e.length
        seen.uids.add(req.uid)
        return {"name": req.name, "uid": req.uid, "size": layout.size, "placement": layout.kind,
                "stripe_unit": layout.stripe_unit, "segment_sizes": list(layout.segment_sizes),
                "segment_extents": list(layout.segment_extents), "persistent": bool(req.persistent),
                "created_at": now, "state": "creating", "replicas": req.replicas, "extents": extents}

    def _write_creates(self, batch: list[Create]) -> None:
        """Plan the creates of ``batch`` on one read, in order, each seeing the ones
        before it, and write them in as few transactions as etcd takes (each compares
        that its region's key is absent, and all that the extent id counter is as read);
        creates of a transaction that lost a race are planned again from a fresh read."""
        pending = batch
        for _ in range(COMMIT_ATTEMPTS):
            with self._lock:
                pending = self._write_some(pending)
            if not pending:
                return
        for item in pending:
            item.fail(errors.ControllerUnavailable(f"creating region {item.request[0].name}: etcd kept "
                                                   f"changing under this controller; retry"))

    def _write_some(self, items: list[Create]
                    ) -> list[Create]:
        """One pass of :meth:`_write_creates`; returns the items to plan again."""
        snap = self._snapshot(extra=(self.next_id_key,))
        counter = snap.extra[self.next_id_key]
        next_id = int(counter.value) if counter is not None else FIRST_ID_BASE + secrets.randbits(61)
        counter_rev = counter.mod_revision if counter is not None else 0
        seen = _Seen(snap.server_records(), {row["uid"] for row, _ in snap.regions.values()}, {})
        chunk: list[tuple[Create, dict[str, Any]]] = []
        compare: list[kv.Cmp] = []
        ops: list[kv.Op] = []
        for k, item in enumerate(items):
            (req, now) = item.request
            try:
                row = self._plan(req, now, snap, seen, next_id)
            except errors.SMBError as exc:
                item.fail(exc)
                continue
            key = self._key("regions", req.name)
            mine = [kv.put(key, json.dumps(row))] + [
                kv.put(self._key("placed", sid, eid), json.dumps({"uid": req.uid, "name": req.name, "length": n}))
                for eid, _, sid, n, *_ in row["extents"]]
            if chunk and (len(ops) + len(mine) + 1 > MAX_TXN_OPS or len(compare) + 4 > MAX_TXN_OPS):
                revision = self._commit(compare + [kv.mod_revision_is(self.next_id_key, counter_rev)],
                                        ops + [kv.put(self.next_id_key, str(next_id))])
                if not revision:
                    return [c for c, _ in chunk] + items[k:]
                self._created(chunk, snap, revision)
                chunk, compare, ops, counter_rev = [], [], [], revision
            chunk.append((item, row))
            compare.append(kv.absent(key))
            ops += mine
            next_id += len(row["extents"])
            snap.regions[req.name] = (row, 0)   # the next plans see its name (its bytes: ``seen``)
        if chunk:
            revision = self._commit(compare + [kv.mod_revision_is(self.next_id_key, counter_rev)],
                                    ops + [kv.put(self.next_id_key, str(next_id))])
            if not revision:
                return [c for c, _ in chunk]
            self._created(chunk, snap, revision)
        return []

    def _created(self, chunk: list[tuple[Create, dict[str, Any]]],
                 snap: Snapshot, revision: int) -> None:
        for item, row in chunk:
            region = snap.region(row)
            self._begun.remember(row["name"], Begun(row, revision, region))
            item.answer(region)

