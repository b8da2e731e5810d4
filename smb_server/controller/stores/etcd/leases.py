"""Owner leases in the etcd store (:class:`.etcd.state.EtcdState` builds on it): keys
``P/owner_leases/<owner>`` (the lease) and ``P/region_leases/<name>`` (its owner), each
change one transaction applying what :mod:`.rules` decides."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict

from ...records import check_lease
from ...rules import OwnerLease, lapsed, leased, renewed
from . import kv
from .txn import EtcdStore

log = logging.getLogger(__name__)


class EtcdLeases(EtcdStore):
    """Owner leases (as :class:`.sqlite.leases.OwnerLeases`)."""

    def lease_region(self, name: str, owner: str, seconds: float, now: float | None = None) -> None:
        """Tie region ``name`` to ``owner``'s lease of ``seconds`` (one transaction)."""
        owner, seconds, now = check_lease(owner, seconds), float(seconds), self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> bool | None:
            row, rev = self._read_one("owner_leases", owner)
            lease = leased(OwnerLease(**row) if row else None, seconds, now)
            compare = [kv.mod_revision_is(key, rev) if row else kv.absent(key)]
            ops = [kv.put(self._key("region_leases", name), owner), kv.put(key, json.dumps(asdict(lease)))]
            return True if self._commit(compare, ops) else None
        self._retry(attempt, f"leasing region {name}", regions=False)

    def renew_lease(self, owner: str, now: float | None = None) -> int:
        """Renew ``owner``'s lease; how many regions it holds (0: none, or run out)."""
        now = self._now(now)
        key = self._key("owner_leases", owner)

        def attempt() -> int | None:
            row, rev = self._read_one("owner_leases", owner)
            lease = renewed(OwnerLease(**row) if row else None, now)
            if lease is None:
                return 0
            (leases,) = self.kv.read(kv.get_prefix(self._key("region_leases", "")))
            held = sum(1 for item in leases if item.value.decode() == owner)
            return held if self._commit([kv.mod_revision_is(key, rev)],
                                        [kv.put(key, json.dumps(asdict(lease)))]) else None
        return self._retry(attempt, f"renewing the lease of {owner}", regions=False)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ready regions whose owner's lease ran out, by name; forgets owners that hold
        no region any more."""
        now = self._now(now)
        owners_prefix, leases_prefix = self._key("owner_leases", ""), self._key("region_leases", "")
        owners, leases, regions = self.kv.read(kv.get_prefix(owners_prefix), kv.get_prefix(leases_prefix),
                                               kv.get_prefix(self._key("regions", "")))
        revisions = {item.key[len(owners_prefix):]: item.mod_revision for item in owners}
        expired, idle = lapsed({item.key[len(owners_prefix):]: OwnerLease(**item.json()) for item in owners},
                               {item.key[len(leases_prefix):]: item.value.decode() for item in leases},
                               [item.json()["name"] for item in regions if item.json()["state"] == "ready"], now)
        if idle:
            self._commit_each(([kv.mod_revision_is(self._key("owner_leases", o), revisions[o])],
                               [kv.delete(self._key("owner_leases", o))]) for o in idle)
        return expired
