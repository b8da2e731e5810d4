"""The SQLite file under :class:`.sqlite.state.ControllerState`: its tables, the connection
with its transactions, and the reads that turn rows into records.

Tables (see ``_SCHEMA``):

- ``servers``: one row per memory server ever registered. ``state`` is ``up``,
  ``down`` (lease expired) or ``draining`` (up, but takes no new extents); ``drain``
  remembers an operator's drain across a down/up cycle.
- ``regions``: ``state`` is ``creating`` while the servicer reserves extents on the
  servers, ``ready`` once committed. Rows still ``creating`` when the database is
  opened belong to a controller that died mid-create; they are removed, and the
  extents the servers did reserve become orphans that the servers free after the
  grace period.
- ``regions.replicas``: copies of every byte (1: unreplicated).
- ``extents``: one row per extent of a region: its layout slot (``idx``) and, in a
  replicated region, its ``copy`` number, ``role`` (primary, backup, syncing, stale)
  and its slot's ``view``; one row per (region, slot, copy).
- ``issued_extent_ids``: every extent id ever handed out, so that an id is never reused
  (an orphan on some server must never be mistaken for a live extent).

- ``lost_extents``: extents a server registered without (restarted without its
  memory); their bytes have no copy anywhere.
- ``done_deletes``: the request ids of deletes done in the last hour, so that a delete
  repeated after its reply was lost (a failover, a timeout) is answered as done.

Schema versions: 1 had no replicas; a version-1 file is upgraded in place when opened
(``replicas`` added to ``regions``; ``extents`` rebuilt with ``copy``, ``role``,
``view`` and the per-copy unique key).
"""
from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from smb_protocol.errors import InvalidArgument
from smb_protocol.replicas import ReplicaRole

from ...moves import DRAIN_EVACUATE
from ...records import ExtentRecord, RegionRecord, ServerRecord, region_state

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_ID_ATTEMPTS = 16

_ROLES = ", ".join(f"'{r.value}'" for r in ReplicaRole)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS servers (
    server_id      TEXT PRIMARY KEY,
    host_id        TEXT NOT NULL DEFAULT '',
    grpc_address   TEXT NOT NULL,
    endpoints      TEXT NOT NULL DEFAULT '[]',
    capacity       INTEGER NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('up', 'down', 'draining')),
    drain          INTEGER NOT NULL DEFAULT 0,
    last_heartbeat REAL NOT NULL,
    registered_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS regions (
    name            TEXT PRIMARY KEY,
    uid             TEXT NOT NULL UNIQUE,
    size            INTEGER NOT NULL,
    placement       TEXT NOT NULL,
    stripe_unit     INTEGER NOT NULL DEFAULT 0,
    segment_sizes   TEXT NOT NULL DEFAULT '[]',
    segment_extents TEXT NOT NULL DEFAULT '[]',
    persistent      INTEGER NOT NULL DEFAULT 0,
    created_at      REAL NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('creating', 'ready')),
    replicas        INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS extents (
    extent_id   INTEGER PRIMARY KEY,
    region_name TEXT NOT NULL REFERENCES regions(name) ON DELETE CASCADE,
    idx         INTEGER NOT NULL,
    server_id   TEXT NOT NULL REFERENCES servers(server_id),
    length      INTEGER NOT NULL,
    copy        INTEGER NOT NULL DEFAULT 0,
    role        TEXT NOT NULL DEFAULT '' CHECK (role IN ({_ROLES})),
    view        INTEGER NOT NULL DEFAULT 0,
    UNIQUE (region_name, idx, copy)
);
CREATE INDEX IF NOT EXISTS extents_by_server ON extents(server_id);
CREATE TABLE IF NOT EXISTS lost_extents (
    extent_id INTEGER PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS issued_extent_ids (
    extent_id INTEGER PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS region_leases (
    name    TEXT PRIMARY KEY REFERENCES regions(name) ON DELETE CASCADE,
    owner   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS region_leases_by_owner ON region_leases(owner);
CREATE TABLE IF NOT EXISTS owner_leases (
    owner   TEXT PRIMARY KEY,
    seconds REAL NOT NULL,
    expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS removed_servers (
    server_id  TEXT PRIMARY KEY,
    removed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS done_deletes (
    request_id TEXT PRIMARY KEY,
    name       TEXT NOT NULL,
    deleted_at REAL NOT NULL,
    region     TEXT NOT NULL DEFAULT ''
);
"""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _upgrade(db: sqlite3.Connection, path: str) -> None:
    """Bring tables of an older schema (version 1: no replicas) up to this one, in the
    caller's transaction: add ``regions.replicas``; rebuild ``extents`` with ``copy``,
    ``role``, ``view`` and UNIQUE (region, slot, copy) (SQLite cannot change a table's
    constraints in place)."""
    if "replicas" not in _columns(db, "regions"):
        db.execute("ALTER TABLE regions ADD COLUMN replicas INTEGER NOT NULL DEFAULT 1")
        log.info("%s: regions upgraded with replicas", path)
    if "region" not in _columns(db, "done_deletes"):
        db.execute("ALTER TABLE done_deletes ADD COLUMN region TEXT NOT NULL DEFAULT ''")
        log.info("%s: done deletes upgraded with the region's extents", path)
    if "copy" not in _columns(db, "extents"):
        create = _SCHEMA[_SCHEMA.index("CREATE TABLE IF NOT EXISTS extents"):]
        create = create[:create.index(";")].replace("IF NOT EXISTS extents", "extents_new")
        db.execute(create)
        db.execute("INSERT INTO extents_new (extent_id, region_name, idx, server_id, length) "
                   "SELECT extent_id, region_name, idx, server_id, length FROM extents")
        db.execute("DROP TABLE extents")
        db.execute("ALTER TABLE extents_new RENAME TO extents")
        db.execute("CREATE INDEX IF NOT EXISTS extents_by_server ON extents(server_id)")
        log.info("%s: extents upgraded with copy, role and view", path)


class SqliteDb:
    """One SQLite connection (WAL journal, ``synchronous=NORMAL``, foreign keys on) and
    the lock that guards it; owns the connection. Opening creates the tables, or brings
    an older schema up to this one; a newer schema is refused (InvalidArgument)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._closed = False
        try:
            self._open()
        except BaseException:
            self._db.close()
            raise

    def _open(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        path = self.path
        with self.tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise InvalidArgument(f"{path}: database schema version {version} is newer than "
                                      f"this controller's ({SCHEMA_VERSION}); upgrade the controller")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            _upgrade(db, path)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock (BEGIN IMMEDIATE ... COMMIT/ROLLBACK)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A consistent read (one deferred transaction) under the lock."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()


class SqliteStore:
    """What the parts of the SQLite store share: the database (set by
    :class:`.sqlite.state.ControllerState`, which owns it) and its lease settings."""

    _sql: SqliteDb
    lease_seconds: float          # seconds a silent memory server stays up
    orphan_grace_seconds: float   # seconds before an unknown held extent is an orphan

    @staticmethod
    def _now(now: float | None) -> float:
        """``now``, or the time now (unix seconds)."""
        return time.time() if now is None else float(now)


def known_extents(db: sqlite3.Connection, server_id: str) -> dict[int, tuple[str, str]]:
    """extent id -> (region uid, region state) of the extents placed on a server."""
    rows = db.execute(
        "SELECT e.extent_id, r.uid, r.state FROM extents e JOIN regions r ON r.name = e.region_name "
        "WHERE e.server_id=?", (server_id,))
    return {r["extent_id"]: (r["uid"], r["state"]) for r in rows}


def new_extent_id(db: sqlite3.Connection) -> int:
    """A fresh extent id, recorded as issued (ids are never reused)."""
    for _ in range(_ID_ATTEMPTS):
        candidate = secrets.randbits(63)
        if candidate == 0:
            continue
        try:
            db.execute("INSERT INTO issued_extent_ids (extent_id) VALUES (?)", (candidate,))
        except sqlite3.IntegrityError:  # issued before: never reuse
            continue
        return candidate
    raise RuntimeError("could not draw an unused extent id")  # pragma: no cover


def load_region(db: sqlite3.Connection, name: str) -> RegionRecord | None:
    """Region ``name`` with its extents as clients see them (None when there is none)."""
    row = db.execute("SELECT * FROM regions WHERE name=?", (name,)).fetchone()
    if row is None:
        return None
    lost = {r["extent_id"] for r in db.execute(
        "SELECT l.extent_id FROM lost_extents l JOIN extents e ON e.extent_id = l.extent_id "
        "WHERE e.region_name=?", (name,))}
    extents = tuple(
        ExtentRecord(e["extent_id"], e["idx"], e["server_id"], e["length"], e["grpc_address"],
                    e["host_id"], tuple(json.loads(e["endpoints"])), e["state"],
                    e["extent_id"] in lost, e["copy"], ReplicaRole.parse(e["role"]), e["view"])
        for e in db.execute(
            "SELECT e.extent_id, e.idx, e.server_id, e.length, e.copy, e.role, e.view, "
            "s.grpc_address, s.host_id, s.endpoints, s.state FROM extents e "
            "JOIN servers s ON s.server_id = e.server_id "
            "WHERE e.region_name=? ORDER BY e.idx, e.copy", (name,)))
    replicas = int(row["replicas"])
    state = region_state(row["state"], extents, replicas)
    return RegionRecord(row["name"], row["uid"], row["size"], row["placement"], row["stripe_unit"],
                        tuple(json.loads(row["segment_sizes"])),
                        tuple(json.loads(row["segment_extents"])), bool(row["persistent"]),
                        row["created_at"], state, extents, replicas)


def server_records(db: sqlite3.Connection) -> list[ServerRecord]:
    """Every server ever registered, by id, with ``used`` computed from its extents."""
    rows = db.execute(
        "SELECT s.*, COALESCE(SUM(e.length), 0) AS used, COUNT(e.extent_id) AS n "
        "FROM servers s LEFT JOIN extents e ON e.server_id = s.server_id "
        "GROUP BY s.server_id ORDER BY s.server_id").fetchall()
    return [ServerRecord(r["server_id"], r["host_id"], r["grpc_address"],
                         tuple(json.loads(r["endpoints"])), r["capacity"], r["used"], r["n"],
                         r["state"], r["last_heartbeat"], r["registered_at"],
                         r["drain"] == DRAIN_EVACUATE) for r in rows]
