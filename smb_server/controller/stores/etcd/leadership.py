"""The etcd store's side of leadership (:class:`.stores.protocol.Leadership`;
:class:`.etcd.state.EtcdState` builds on it): standing by, the election on the store's
channel, a take-over that cleans what a dead leader left half-done, stepping down, and
barriers' generations, which outlive a leader."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from smb_protocol import errors

from ...leader import Election
from ...rules import half_created, refreshed_on_take_over, report_half_created
from . import kv
from .txn import EtcdStore, Fence

log = logging.getLogger(__name__)


class EtcdLeadership(EtcdStore):
    """Leadership and barriers' generations on etcd (keys ``P/epoch``, ``P/leader``,
    ``P/barriers/<name>``, ``P/barrier_arrivals/<name>``)."""

    @property
    def leadership(self) -> EtcdLeadership:
        """This store: its controllers elect a leader."""
        return self

    def stand_by(self) -> None:
        """Refuse every write until :meth:`take_over`."""
        self.fenced = True

    def election(self, address: str, lease_seconds: float) -> Election:
        """This controller's part in the election, on this store's etcd channel."""
        return Election(self.kv, self.prefix, address, lease_seconds)

    def step_down(self) -> None:
        """Stop leading: writes are refused until the next :meth:`take_over`."""
        self.fence = None

    def recover(self) -> list[str]:
        """Remove regions left ``creating`` by a controller that died; returns their names.

        The extents their servers reserved become orphans the servers free after the grace.
        """
        def attempt() -> list[str] | None:
            snap = self._snapshot(servers=False, lost=False)
            stale = half_created({n: row["state"] for n, (row, _) in snap.regions.items()})
            if not self._commit_each(([kv.mod_revision_is(self._key("regions", n), snap.regions[n][1])],
                                       self._removal(snap.regions[n][0])) for n in stale):
                return None
            return stale
        stale = self._retry(attempt, "removing half-created regions")
        report_half_created(stale)
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
                    if refreshed_on_take_over(row["state"], row["last_heartbeat"], now)}
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

    # -- barriers' generations (:class:`.barriers.GenerationStore`) ---------------------------
    def barrier_generation(self, name: str) -> tuple[int, tuple[str, ...]]:
        """How many times barrier ``name`` has opened (0: never) and its last opening's
        arrival ids (``P/barriers/<name>`` and ``P/barrier_arrivals/<name>``)."""
        opened, arrivals = self.kv.read(kv.get(self._key("barriers", name)),
                                        kv.get(self._key("barrier_arrivals", name)))
        return (int(opened[0].value) if opened else 0), (tuple(arrivals[0].json()) if arrivals else ())

    def open_barrier(self, name: str, generation: int, arrivals: Sequence[str]) -> None:
        """Record the ``generation``-th opening of barrier ``name`` with its arrival ids
        (one fenced transaction that compares the generation before it)."""
        key = self._key("barriers", name)
        before = kv.value_is(key, str(generation - 1)) if generation > 1 else kv.absent(key)
        ops = [kv.put(key, str(generation)), kv.put(self._key("barrier_arrivals", name), json.dumps(list(arrivals)))]
        if not self._commit([before], ops):
            raise errors.ControllerUnavailable(f"barrier {name!r} opened elsewhere meanwhile; retry")
