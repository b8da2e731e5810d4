"""Leader election among controllers that share one etcd, and the gate that keeps a
standby from serving.

One controller leads: it holds ``P/leader`` (its address and epoch) on an etcd lease
it keeps alive. Winning is one transaction: the leader key is absent and ``P/epoch``
is unchanged since it was read; it writes ``epoch + 1`` and the leader key. The epoch
and the leader key's create revision are the new leader's :class:`.stores.etcd.txn.Fence`,
checked by every write it makes; a leader that loses its lease (paused, cut off) cannot
write again, because a successor's epoch differs.

Every controller watches the leader key (an etcd watch, no polling). A standby
campaigns the moment the key goes (its leader resigned, or its lease ran out), and
names the leader the watch last showed when it refuses a call. A leader whose key is
deleted under it steps down at once. A leader that has not renewed its lease for a
whole lease (by its own monotonic clock) stops serving at once, before any renewal
tells it so: a leader resumed after a pause never answers a single call as leader.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from smb_protocol import errors
from smb_server.runtime.grpc_util import Continuation, Handler, ServerInterceptor, abort

from .stores.etcd import kv
from .stores.etcd.txn import Fence

log = logging.getLogger(__name__)

RETRY = 0.5         # seconds before the election is tried again after etcd failed it
MIN_LEASE = 2       # seconds; etcd refuses shorter leases
DESCRIBE_REFRESH = 0.1  # seconds between reads of the leader key for refusals' messages


@dataclass(frozen=True)
class LeaderInfo:
    address: str
    epoch: int


class Election:
    """One controller's part in the election; borrows ``store`` (an etcd KV client).

    ``address``: what clients are told to reach this controller at; ``lease_seconds``:
    how long a silent leader keeps the lead (whole seconds, at least ``MIN_LEASE``).
    """

    def __init__(self, store: kv.EtcdKV, prefix: str, address: str, lease_seconds: float) -> None:
        self.kv = store
        self.epoch_key = f"{prefix}/epoch"
        self.leader_key = f"{prefix}/leader"
        self.address = address
        self.ttl = max(MIN_LEASE, math.ceil(lease_seconds))
        self.lease = 0
        self.fence: Fence | None = None
        self._renewed = 0.0  # monotonic seconds of the last successful grant/renewal
        self.known: LeaderInfo | None = None  # the leader as last read or watched
        self.known_revision = 0  # the etcd revision ``known`` is as of
        self.gone_revision = 0   # revision of the last deletion of the leader key seen
        self._described = -DESCRIBE_REFRESH  # monotonic seconds of describe()'s last read

    def current(self) -> LeaderInfo | None:
        """The leader now, or None while there is none (read from etcd)."""
        return self._read_leader()[0]

    def _read_leader(self) -> tuple[LeaderInfo | None, int]:
        """The leader key as read from etcd now, learned, and the revision of the read."""
        result = self.kv.txn([], [kv.get(self.leader_key)])
        (items,) = result.ranges
        leader = _info(items[0]) if items else None
        self._learn(leader, result.revision)
        return leader, result.revision

    def _learn(self, leader: LeaderInfo | None, revision: int) -> None:
        """Take ``leader`` as known unless what is known is of a later revision: a read
        and the watch race, and an event the watch delivers late (a process resumed after
        a pause, a slow stream) must not undo a newer read."""
        if revision >= self.known_revision:
            self.known, self.known_revision = leader, revision

    def observe(self, events: list[kv.WatchEvent]) -> bool:
        """Apply the watch's ``events`` to ``known``; True when the key was deleted (or the
        watch asks for a fresh read: no events), so the caller should wake the loop."""
        for event in events:
            if event.deleted:
                self.gone_revision = max(self.gone_revision, event.kv.mod_revision)
                self._learn(None, event.kv.mod_revision)
            else:
                self._learn(_info(event.kv), event.kv.mod_revision)
        return not events or any(e.deleted for e in events)

    def describe(self) -> str:
        """``at host:port (epoch N)`` of the leader as last seen, for messages.

        No etcd read while the watch names another controller. While it names none, or
        this one (which refuses, so it does not lead: it was paused, or its watch lags
        behind), the leader key is read, at most once per ``DESCRIBE_REFRESH`` seconds.
        """
        known = self.known
        if (known is None or known.address == self.address) and \
                time.monotonic() - self._described >= DESCRIBE_REFRESH:
            self._described = time.monotonic()
            try:
                known = self.current()
            except errors.ControllerUnavailable:
                pass
        return "not elected yet; retry" if known is None else f"at {known.address} (epoch {known.epoch})"

    def watch(self, wake: Callable[[], None]) -> kv.Watch:
        """Follow the leader key from now on: ``known`` and ``gone_revision`` stay current,
        and ``wake()`` runs when the key is deleted (or must be read afresh). The caller
        cancels the watch."""
        _, revision = self._read_leader()

        def on_events(events: list[kv.WatchEvent]) -> None:
            if self.observe(events):
                wake()
        return self.kv.watch(self.leader_key, revision + 1, on_events)

    def deposed(self) -> bool:
        """True when the leader key this controller wrote has been deleted."""
        return self.fence is not None and self.gone_revision > self.fence.leader_revision

    def campaign(self) -> Fence | None:
        """Try once to lead; returns the fence when this controller won."""
        read = self.kv.txn([], [kv.get(self.leader_key), kv.get(self.epoch_key)])
        leader, epochs = read.ranges
        self._learn(_info(leader[0]) if leader else None, read.revision)
        if leader:
            return None
        epoch_item = epochs[0] if epochs else None
        epoch = int(epoch_item.value) + 1 if epoch_item is not None else 1
        started = time.monotonic()
        lease = self.kv.grant(self.ttl)
        value = json.dumps({"address": self.address, "epoch": epoch})
        result = self.kv.txn(
            [kv.absent(self.leader_key),
             kv.mod_revision_is(self.epoch_key, epoch_item.mod_revision if epoch_item else 0)],
            [kv.put(self.epoch_key, str(epoch)), kv.put(self.leader_key, value, lease)])
        if not result.succeeded:
            self.kv.revoke(lease)
            return None
        self.lease, self._renewed = lease, started
        self.fence = Fence(epoch, result.revision)
        self._learn(LeaderInfo(self.address, epoch), result.revision)
        log.info("leading the controllers at %s (epoch %d, lease %d s)", self.address, epoch, self.ttl)
        return self.fence

    def leading(self) -> bool:
        """True while this controller won and its lease surely has not run out."""
        return self.fence is not None and time.monotonic() - self._renewed < self.ttl

    def renew(self) -> bool:
        """Keep the lease alive; False (and no longer leading) once it is lost."""
        if self.fence is None:
            return False
        sent = time.monotonic()
        try:
            ttl = self.kv.keepalive(self.lease)
        except errors.ControllerUnavailable as exc:
            log.warning("cannot renew the leader lease: %s", exc)
            return self.leading()
        if ttl <= 0 or not self.leading():
            self.step_down("the leader lease expired")
            return False
        self._renewed = sent
        return True

    def step_down(self, reason: str) -> None:
        """Stop leading (the lease is revoked, so a standby takes over at once)."""
        if self.fence is None:
            return
        log.warning("no longer leading (epoch %d): %s", self.fence.epoch, reason)
        self.fence = None
        lease, self.lease = self.lease, 0
        self.kv.revoke(lease)


def _info(item: kv.KeyValue) -> LeaderInfo:
    row = item.json()
    return LeaderInfo(row["address"], int(row["epoch"]))


class LeaderGate(ServerInterceptor):
    """Refuses every call to ``service`` with ControllerUnavailable naming the leader
    unless ``leading()``; other services (health) pass."""

    def __init__(self, service: str, leading: Callable[[], bool], leader: Callable[[], str]) -> None:
        self._prefix = f"/{service}/"
        self._leading = leading

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            abort(context, errors.ControllerUnavailable(
                f"this controller stands by; the leader is {leader()}"))

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        if details.method.startswith(self._prefix) and not self._leading():
            return self._refuse
        return continuation(details)


class LeaderLoop:
    """The thread that campaigns while standing by and renews while leading, woken by
    the watch on the leader key the moment the key goes.

    ``on_lead(fence)`` runs when this controller starts to lead (it should hand the fence
    to the state); ``on_lose()`` when it stops.
    """

    def __init__(self, election: Election, on_lead: Callable[[Fence], None],
                 on_lose: Callable[[], None]) -> None:
        self.election = election
        self.on_lead = on_lead
        self.on_lose = on_lose
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="controller-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _step(self, watch: kv.Watch | None) -> tuple[float, kv.Watch | None]:
        """One turn of the loop; returns how long to wait for the watch, and the watch."""
        e = self.election
        if watch is None:
            watch = e.watch(self._wake.set)
        if e.fence is None:
            fence = e.campaign()
            if fence is None:
                return e.ttl, watch   # until the key goes; the lease bounds a missed event
            try:
                self.on_lead(fence)
            except Exception:
                log.exception("taking over failed; standing by again")
                e.step_down("taking over failed")
                self.on_lose()
                return RETRY, watch
            return e.ttl / 3, watch
        if e.deposed():
            e.step_down("its leader key was deleted")
        elif e.renew():
            return e.ttl / 3, watch
        self.on_lose()
        return 0.0, watch

    def _run(self) -> None:
        e = self.election
        watch: kv.Watch | None = None
        try:
            while not self._stop.is_set():
                self._wake.clear()   # before reading: a change from here on wakes the wait
                try:
                    wait, watch = self._step(watch)
                except errors.SMBError as exc:
                    log.warning("election: %s", exc)
                    if e.fence is not None and not e.leading():
                        e.step_down("etcd unreachable for a whole lease")
                        self.on_lose()
                    wait = RETRY
                except Exception:
                    log.exception("election")
                    wait = RETRY
                if wait > 0:
                    self._wake.wait(wait)
        finally:
            if watch is not None:
                watch.cancel()

    def stop(self, resign: bool = True) -> None:
        """End the thread; with ``resign``, give up the lead so a standby takes over now."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if resign and self.election.fence is not None:
            self.election.step_down("stopping")
            self.on_lose()
