"""Owner leases in the SQLite store (:class:`.sqlite.state.ControllerState` builds on it): a
region tied to its owner's lease, renewals, and the regions of owners that stopped
renewing, each one transaction that applies what the rules of :mod:`.rules` decide."""
from __future__ import annotations

import logging
import sqlite3

from ...records import check_lease
from ...rules import OwnerLease, lapsed, leased, renewed
from .db import SqliteStore

log = logging.getLogger(__name__)


class OwnerLeases(SqliteStore):
    """Owner leases (tables ``region_leases`` and ``owner_leases``)."""

    def lease_region(self, name: str, owner: str, seconds: float, now: float | None = None) -> None:
        """Tie region ``name`` to ``owner``'s lease of ``seconds``: once the owner renewed
        nothing for that long (the longest lease of its regions), :meth:`expired_leases`
        names the region. Raises InvalidArgument for a bad owner or lease."""
        owner, seconds, now = check_lease(owner, seconds), float(seconds), self._now(now)
        with self._sql.tx() as db:
            lease = leased(_owner_lease(db, owner), seconds, now)
            db.execute("INSERT OR REPLACE INTO region_leases (name, owner) VALUES (?, ?)", (name, owner))
            db.execute("INSERT OR REPLACE INTO owner_leases (owner, seconds, expires) VALUES (?, ?, ?)",
                       (owner, lease.seconds, lease.expires))

    def renew_lease(self, owner: str, now: float | None = None) -> int:
        """Renew ``owner``'s lease; returns how many regions it holds (0: none, or the
        lease had run out and they are gone)."""
        now = self._now(now)
        with self._sql.tx() as db:
            lease = renewed(_owner_lease(db, owner), now)
            if lease is None:
                return 0
            db.execute("UPDATE owner_leases SET expires=? WHERE owner=?", (lease.expires, owner))
            return int(db.execute("SELECT count(*) FROM region_leases WHERE owner=?", (owner,)).fetchone()[0])

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ready regions whose owner's lease ran out, by name; forgets owners that hold
        no region any more."""
        now = self._now(now)
        with self._sql.tx() as db:
            owners = {r["owner"]: OwnerLease(r["seconds"], r["expires"])
                      for r in db.execute("SELECT owner, seconds, expires FROM owner_leases")}
            holders = {r["name"]: r["owner"] for r in db.execute("SELECT name, owner FROM region_leases")}
            ready = [r["name"] for r in db.execute("SELECT name FROM regions WHERE state='ready'")]
            regions, idle = lapsed(owners, holders, ready, now)
            db.executemany("DELETE FROM owner_leases WHERE owner=?", [(owner,) for owner in idle])
        return regions


def _owner_lease(db: sqlite3.Connection, owner: str) -> OwnerLease | None:
    row = db.execute("SELECT seconds, expires FROM owner_leases WHERE owner=?", (owner,)).fetchone()
    return None if row is None else OwnerLease(row["seconds"], row["expires"])
