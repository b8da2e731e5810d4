"""Leader election and fencing on a real etcd server: one leader at a time, epochs
that grow, and a deposed leader whose every write fails in the etcd transaction."""
from __future__ import annotations

import threading
import time

import pytest

from smb_protocol import errors
from smb_server.controller.leader import Election, LeaderLoop
from smb_server.controller.records import CreateRequest, HeldExtent, RegionRecord
from smb_server.controller.stores.etcd import kv
from smb_server.controller.stores.etcd.state import EtcdState
from smb_server.controller.stores.etcd.txn import Fence

MiB = 1 << 20


def _pair(url: str) -> tuple[EtcdState, EtcdState, Election, Election]:
    a, b = EtcdState(url, recover=False), EtcdState(url, recover=False)
    a.stand_by()
    b.stand_by()
    return a, b, a.election("10.0.0.1:7700", 2), b.election("10.0.0.2:7700", 2)


def lead(state: EtcdState, election: Election) -> Fence:
    """``election`` wins its campaign and ``state`` takes over as the leader; returns the
    fence its writes go under."""
    fence = election.campaign()
    assert fence is not None
    state.take_over(fence)
    return fence


def test_one_leader_at_a_time_and_epochs_grow(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    fence = ea.campaign()
    assert fence is not None and fence.epoch == 1 and ea.leading()
    assert eb.campaign() is None and not eb.leading()
    assert eb.current() is not None and eb.current().address == "10.0.0.1:7700"  # type: ignore[union-attr]
    assert ea.renew()
    ea.step_down("test")                      # resigning frees the lead at once
    assert not ea.leading() and eb.current() is None
    again = eb.campaign()
    assert again is not None and again.epoch == 2
    assert a.describe_leader() == "at 10.0.0.2:7700 (epoch 2)"


def test_a_standby_writes_nothing(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    with pytest.raises(errors.ControllerUnavailable, match="stands by"):
        b.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    assert b.list_servers() == []


def test_a_leader_that_steps_down_writes_nothing(etcd_store: str) -> None:
    a, _, ea, _ = _pair(etcd_store)
    assert a.leadership is a                    # the store interface's side of the election
    lead(a, ea)
    a.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    a.step_down()
    with pytest.raises(errors.ControllerUnavailable, match="stands by"):
        a.drain("s1")
    assert a.get_server("s1").state == "up"


def test_a_deposed_leader_cannot_write(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    fence_a = lead(a, ea)
    a.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    a.commit_region("job/x", a.begin_create_region(CreateRequest("job/x", MiB)).uid)
    # a's lease runs out while it is paused (its process does not renew), b takes over
    a.kv.revoke(ea.lease)
    fence_b = lead(b, eb)
    assert fence_b.epoch == fence_a.epoch + 1
    # a still believes it leads: every kind of write fails in etcd, nothing applied
    with pytest.raises(errors.ControllerUnavailable, match="no longer leads.*10.0.0.2:7700"):
        a.begin_create_region(CreateRequest("job/y", MiB))
    with pytest.raises(errors.ControllerUnavailable, match="no longer leads"):
        a.delete_region("job/x")
    with pytest.raises(errors.ControllerUnavailable, match="no longer leads"):
        a.heartbeat("s1", [])
    with pytest.raises(errors.ControllerUnavailable, match="no longer leads"):
        a.expire_leases(now=time.time() + 3600)
    assert [r.name for r in b.list_regions()] == ["job/x"]
    assert b.get_server("s1").state == "up"
    b.commit_region("job/y", b.begin_create_region(CreateRequest("job/y", MiB)).uid)
    assert [r.name for r in b.list_regions()] == ["job/x", "job/y"]


def test_a_new_leader_removes_half_created_regions(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    lead(a, ea)
    a.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    a.begin_create_region(CreateRequest("job/half", MiB))   # the leader dies here
    ea.step_down("died")
    lead(b, eb)
    with pytest.raises(errors.RegionNotFound):
        b.get_region("job/half")
    b.commit_region("job/half", b.begin_create_region(CreateRequest("job/half", MiB)).uid)  # the name is free again


def test_a_new_leader_repairs_the_placed_extent_index(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    lead(a, ea)
    a.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    region = a.commit_region("job/x", a.begin_create_region(CreateRequest("job/x", MiB)).uid)
    (extent,) = region.extents
    # the index lost its entry (a store written before it, or edited by hand), and holds a stray one
    a.kv.txn([], [kv.delete(f"{a.prefix}/placed/s1/{extent.extent_id}"),
                  kv.put(f"{a.prefix}/placed/s1/12345", '{"uid": "gone", "name": "x", "length": 1}')])
    ea.step_down("test")
    lead(b, eb)
    held = [HeldExtent(extent.extent_id, region.uid, MiB, 1e6), HeldExtent(12345, "gone", 1, 1e6)]
    assert b.heartbeat("s1", held) == [12345]   # its own extent is known again, the stray one is not


def test_heartbeats_do_not_queue_behind_region_changes(etcd_store: str) -> None:
    state = EtcdState(etcd_store)
    state.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    done = threading.Event()

    def beat() -> None:
        state.heartbeat("s1", [])
        state.expire_leases()
        done.set()

    with state._lock:  # a region change in progress in another thread of the controller
        worker = threading.Thread(target=beat)
        worker.start()
        assert done.wait(30), "the heartbeat waited for the region lock"
    worker.join()


class _CreateDuringTakeOver(EtcdState):
    """Starts a region create in another thread just as its recovery is about to run
    (the moment a new leader's first calls may arrive)."""

    created: list[RegionRecord]

    def recover(self) -> list[str]:
        if self.fence is not None and not hasattr(self, "created"):
            self.created = []
            self.racer = threading.Thread(
                target=lambda: self.created.append(self.begin_create_region(CreateRequest("job/early", MiB))))
            self.racer.start()
            self.racer.join(1.0)  # time enough to run, unless it waits for the take-over
        return super().recover()


def test_a_create_arriving_during_take_over_is_not_taken_for_a_dead_leaders(etcd_store: str) -> None:
    seed = EtcdState(etcd_store)
    seed.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    state = _CreateDuringTakeOver(etcd_store, recover=False)
    state.fenced = True
    election = Election(state.kv, state.prefix, "10.0.0.9:7700", 2)
    lead(state, election)
    state.racer.join(30)
    (early,) = state.created
    assert state.commit_region("job/early", early.uid).state == "ready"


class _Counting(Election):
    """An election that says when a campaign of its found a leader in place."""

    lost_once: threading.Event

    def campaign(self) -> Fence | None:
        fence = super().campaign()
        if fence is None:
            self.lost_once.set()
        return fence


def test_a_standby_campaigns_the_moment_the_leader_key_goes(etcd_store: str) -> None:
    a, b, ea, _ = _pair(etcd_store)
    assert ea.campaign() is not None
    eb = _Counting(b.kv, b.prefix, "10.0.0.2:7700", 2)
    eb.lost_once = threading.Event()
    led = threading.Event()
    loop = LeaderLoop(eb, lambda fence: led.set(), lambda: None)
    loop.start()
    try:
        assert eb.lost_once.wait(10)          # b stands by, its campaign lost
        assert eb.describe() == "at 10.0.0.1:7700 (epoch 1)"
        gone = time.monotonic()
        ea.step_down("resigning")             # the key goes with a's lease
        assert led.wait(10)
        # woken by the watch: well within the lease (2 s) b would otherwise wait out
        assert time.monotonic() - gone < 1.0
        assert eb.fence is not None and eb.fence.epoch == 2
    finally:
        loop.stop()


def test_a_leader_whose_key_is_deleted_steps_down_at_once(etcd_store: str) -> None:
    a, _, ea, _ = _pair(etcd_store)
    led, lost = threading.Event(), threading.Event()
    loop = LeaderLoop(ea, lambda fence: led.set(), lost.set)
    loop.start()
    try:
        assert led.wait(10)
        a.kv.txn([], [kv.delete(f"{a.prefix}/leader")])   # by hand; the lease still runs
        assert lost.wait(1.5)                 # well before its next renewal would tell it
        assert ea.fence is None or ea.fence.epoch == 2   # it may have won again since
    finally:
        loop.stop()


def test_a_barrier_opening_is_kept_with_its_arrivals_and_fenced(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    lead(a, ea)
    assert b.barrier_generation("train/step") == (0, ())
    a.open_barrier("train/step", 1, ["a" * 32, ""])
    a.open_barrier("train/step", 2, ["b" * 32, "c" * 32])
    assert b.barrier_generation("train/step") == (2, ("b" * 32, "c" * 32))   # what a new leader reads
    with pytest.raises(errors.ControllerUnavailable, match="opened elsewhere"):
        a.open_barrier("train/step", 2, ["d" * 32])       # decided on an older generation
    with pytest.raises(errors.ControllerUnavailable, match="stands by"):
        b.open_barrier("train/step", 3, [])               # a standby opens nothing
    assert b.barrier_generation("train/step") == (2, ("b" * 32, "c" * 32))


def test_a_refusal_names_the_leader_even_when_the_watch_lags(etcd_store: str) -> None:
    a, b, ea, eb = _pair(etcd_store)
    fence_a = ea.campaign()
    assert fence_a is not None
    eb.known = None                           # its watch has not shown the leader yet
    assert eb.describe() == "at 10.0.0.1:7700 (epoch 1)"
    # a is paused: its lease runs out and b leads, but a's watch still names a itself
    a.kv.revoke(ea.lease)
    assert eb.campaign() is not None
    assert ea.known is not None and ea.known.address == "10.0.0.1:7700"
    assert ea.describe() == "at 10.0.0.2:7700 (epoch 2)"


def test_a_late_watch_event_does_not_undo_a_newer_read(etcd_store: str) -> None:
    """A leader resumed after a pause answers a queued call at once (reading the new
    leader) before its watch delivers the old key's deletion: the late event, of an
    older revision, must not make the next refusal say no leader is elected."""
    a, b, ea, eb = _pair(etcd_store)
    assert ea.campaign() is not None
    a.kv.revoke(ea.lease)                     # a paused: its lease runs out, the key goes
    deleted_at = a.kv.txn([], []).revision
    assert eb.campaign() is not None
    assert ea.describe() == "at 10.0.0.2:7700 (epoch 2)"   # the queued call's refusal
    late = kv.WatchEvent(True, kv.KeyValue(f"{a.prefix}/leader", b"", 0, deleted_at))
    assert ea.observe([late])                 # a deletion still wakes the loop
    assert ea.known is not None and ea.known.address == "10.0.0.2:7700"
    assert ea.describe() == "at 10.0.0.2:7700 (epoch 2)"
