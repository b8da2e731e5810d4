"""The repair manager's sequences against an in-memory MemoryServers (that keeps each
extent's view and role as a memory server does) and a real SQLite ControllerState."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pytest

from smb_protocol import errors
from smb_server.controller.creation import RegionCreator
from smb_server.controller.memservers import Backup
from smb_server.controller.records import (
    CreateRequest,
    ExtentRecord,
    FailedReplica,
    HeldExtent,
    NewCopy,
    RegionRecord,
    SlotChange,
)
from smb_server.controller.repair import AVOID_SECONDS, RETRY_SECONDS, RepairManager, plan_fence
from smb_server.controller.stores.sqlite.state import ControllerState
from tests.unit.server.controller.test_creation import InMemoryServers

MiB = 1 << 20


class ReplicaServers(InMemoryServers):
    """Also keeps (view, role, backups) per extent and refuses older views, as memory
    servers do; ``dead``: addresses that answer nothing (every call is recorded in
    ``calls`` first, so a test can see that none went to a dead server)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: dict[int, tuple[int, str, list[tuple[int, bool]]]] = {}
        self.dead: set[str] = set()
        self.calls: list[str] = []
        self.sync_fails_once: errors.SMBError | None = None

    def _reach(self, address: str) -> None:
        self.calls.append(address)
        if address in self.dead:
            raise errors.ServerUnavailable(f"{address}: connection refused")

    def reserve(self, address: str, region_uid: str, extent: ExtentRecord,
                persistent: bool = False) -> None:
        self._reach(address)
        super().reserve(address, region_uid, extent, persistent)

    def release(self, address: str, region_uid: str, extent: ExtentRecord) -> bool:
        self._reach(address)
        return super().release(address, region_uid, extent)

    def configure_replicas(self, address: str, region_uid: str, extent: ExtentRecord, view: int,
                           role: str, backups: Sequence[Backup] = ()) -> tuple[int, int]:
        self._reach(address)
        if any(b.sync for b in backups) and self.sync_fails_once is not None:
            exc, self.sync_fails_once = self.sync_fails_once, None
            raise exc
        current = self.config.get(extent.extent_id)
        if current is not None and view < current[0]:
            raise errors.InvalidArgument(f"view {view} is older than {current[0]}")
        got = super().configure_replicas(address, region_uid, extent, view, role, backups)
        self.config[extent.extent_id] = (view, role, [(b.extent.extent_id, b.sync) for b in backups])
        return got


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def state() -> Iterator[ControllerState]:
    s = ControllerState(":memory:", lease_seconds=1e9)
    yield s
    s.close()


@pytest.fixture
def servers() -> ReplicaServers:
    return ReplicaServers()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def manager(state: ControllerState, servers: ReplicaServers, clock: Clock) -> Iterator[RepairManager]:
    m = RepairManager(state, servers, sync_workers=2, clock=clock)
    yield m
    m.close()


def add_servers(state: ControllerState, n: int, capacity: int = 64 * MiB) -> None:
    for i in range(n):
        state.register_server(f"s{i}", f"h{i}", f"mem{i}:1", [f"tcp://mem{i}:2"], capacity)


def create_all(state: ControllerState, servers: ReplicaServers, *requests: CreateRequest) -> list[RegionRecord]:
    """Create the regions of ``requests`` in turn, through one RegionCreator."""
    creator = RegionCreator(state, servers, threads=2)
    try:
        return [creator.create(request) for request in requests]
    finally:
        creator.close()


def create(state: ControllerState, servers: ReplicaServers, replicas: int = 2, **kw: object) -> RegionRecord:
    request = CreateRequest("job/r", MiB, placement="single", replicas=replicas, **kw)  # type: ignore[arg-type]
    (region,) = create_all(state, servers, request)
    return region


def settle(manager: RepairManager, passes: int = 1) -> None:
    for _ in range(passes):
        manager.run_pass()
        manager.wait(10)


def kill(state: ControllerState, servers: ReplicaServers, sid: str) -> None:
    servers.dead.add(f"mem{sid[1:]}:1")
    state.unregister(sid, "killed")


def with_a_spare(state: ControllerState,
                 servers: ReplicaServers) -> tuple[RegionRecord, ExtentRecord, ExtentRecord, str]:
    """A region of two copies on three servers: the region, its primary, its backup, and
    the server that holds neither (the spare)."""
    add_servers(state, 3)
    region = create(state, servers)
    primary, backup = region.copies_of(0)
    spare = ({"s0", "s1", "s2"} - {primary.server_id, backup.server_id}).pop()
    return region, primary, backup, spare


def two_copies(state: ControllerState, servers: ReplicaServers, manager: RepairManager,
               on: int = 2) -> tuple[RegionRecord, ExtentRecord, ExtentRecord]:
    """A region of two copies placed among ``on`` servers, its views pushed (one repair
    pass): the region as created, its primary, its backup."""
    add_servers(state, on)
    region = create(state, servers)
    primary, backup = region.copies_of(0)
    settle(manager)
    return region, primary, backup


def with_a_dead_backup(state: ControllerState, servers: ReplicaServers,
                       manager: RepairManager) -> tuple[RegionRecord, ExtentRecord, ExtentRecord]:
    """A region of two copies on two servers whose backup's server died, one repair pass
    later (no spare: the region is degraded): the region as created, its primary, its backup."""
    region, primary, backup = two_copies(state, servers, manager)
    kill(state, servers, backup.server_id)
    settle(manager)
    return region, primary, backup


def with_a_dead_primary_of_three(
        state: ControllerState, servers: ReplicaServers,
        manager: RepairManager) -> tuple[RegionRecord, ExtentRecord, ExtentRecord, ExtentRecord]:
    """A region of three copies on four servers, its views pushed, whose primary's server
    has just died (no repair pass since): the region as created, its primary, its backups."""
    add_servers(state, 4)
    region = create(state, servers, replicas=3)
    primary, b1, b2 = region.copies_of(0)
    settle(manager)
    kill(state, servers, primary.server_id)
    return region, primary, b1, b2


def roles(region: RegionRecord, index: int = 0) -> list[tuple[str, str]]:
    return [(c.server_id, c.role) for c in region.copies_of(index)]


def test_a_new_controller_pushes_changed_slots_once(state, servers, clock) -> None:
    add_servers(state, 3)
    region = create(state, servers)
    first = RepairManager(state, servers, clock=clock)
    settle(first)
    assert len(servers.configured) == 2          # the create's; view 1 needs no push
    kill(state, servers, region.copies_of(0)[1].server_id)
    settle(first)
    first.close()
    view = state.get_region("job/r").view_of(0)
    assert view == 4
    servers.configured.clear()
    second = RepairManager(state, servers, clock=clock)   # a restarted controller
    try:
        settle(second)
        assert sorted((c[2], c[3]) for c in servers.configured) == [(4, "backup"), (4, "primary")]
        servers.configured.clear()
        settle(second)
        assert servers.configured == []                   # nothing to do
    finally:
        second.close()
    assert state.get_region("job/r").state == "ready"


def test_a_dead_primary_is_replaced_by_its_backup_then_repaired_onto_a_spare(state, servers, manager) -> None:
    region, primary, backup, spare = with_a_spare(state, servers)
    settle(manager)
    kill(state, servers, primary.server_id)
    servers.calls.clear()
    servers.configured.clear()
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    assert after.primaries()[0].extent_id == backup.extent_id          # the backup leads
    (new,) = after.others()
    assert (new.server_id, new.role, new.copy) == (spare, "backup", 2)
    assert new.extent_id not in region.extent_ids                     # a fresh id
    assert primary.extent_id not in after.extent_ids                  # the stale copy is dropped
    assert primary.grpc_address not in servers.calls                  # never called the dead server
    # the promotion (view 2), then the sync (view 3), then the settled set (view 4)
    seq = [(eid, view, role, bs) for _, eid, view, role, bs in servers.configured]
    assert seq[0] == (backup.extent_id, 2, "primary", [])
    assert seq[1] == (new.extent_id, 3, "backup", [])
    assert seq[2] == (backup.extent_id, 3, "primary", [(new.extent_id, True)])
    assert seq[3:] == [(backup.extent_id, 4, "primary", [(new.extent_id, False)]),
                       (new.extent_id, 4, "backup", [])]
    assert servers.synced_bytes == MiB
    assert manager.metrics.by_kind == {"promote": 1, "spare": 1}


def test_with_three_copies_the_other_backup_is_fenced_first_and_synced_again(state, servers, manager) -> None:
    _, primary, b1, b2 = with_a_dead_primary_of_three(state, servers, manager)
    servers.configured.clear()
    manager.run_pass()
    manager.wait(10)
    seq = [(eid, view, role, bs) for _, eid, view, role, bs in servers.configured]
    # backups first (fencing the old primary), then the new primary with no backups yet
    assert seq[:2] == [(b2.extent_id, 2, "backup", []), (b1.extent_id, 2, "primary", [])]
    # then b2 is copied whole from the new primary at a fresh view
    assert (b1.extent_id, 3, "primary", [(b2.extent_id, True)]) in seq
    settle(manager, 2)   # the third copy goes to the spare
    after = state.get_region("job/r")
    assert after.state == "ready" and len(after.copies_of(0)) == 3
    assert {c.server_id for c in after.copies_of(0)} == {"s0", "s1", "s2", "s3"} - {primary.server_id}
    assert manager.metrics.by_kind == {"promote": 1, "redrive": 1, "spare": 1}


def test_a_dead_backup_is_dropped_and_without_a_spare_the_region_stays_degraded(
        state, servers, manager, caplog) -> None:
    region, primary, backup = two_copies(state, servers, manager)
    servers.configured.clear()
    kill(state, servers, backup.server_id)
    with caplog.at_level(logging.WARNING):
        settle(manager, 3)
    after = state.get_region("job/r")
    assert after.state == "degraded"
    assert roles(after) == [(primary.server_id, "primary"), (backup.server_id, "stale")]
    assert servers.configured == [(primary.grpc_address, primary.extent_id, 2, "primary", [])]
    assert sum("no spare server" in r.message for r in caplog.records) == 1   # said once
    assert after.others() == []


def test_a_returning_server_is_resynced_not_trusted(state, servers, manager) -> None:
    region, primary, backup = with_a_dead_backup(state, servers, manager)
    assert state.get_region("job/r").state == "degraded"
    servers.dead.clear()
    state.heartbeat(backup.server_id, [HeldExtent(backup.extent_id, region.uid, MiB, 1.0)])
    servers.configured.clear()
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready" and sorted(after.extent_ids) == sorted(region.extent_ids)
    assert (primary.grpc_address, primary.extent_id, 3, "primary", [(backup.extent_id, True)]) \
        in servers.configured
    assert manager.metrics.by_kind == {"drop": 1, "resync": 1}


def test_a_lost_backup_is_replaced(state, servers, manager) -> None:
    region, primary, backup = two_copies(state, servers, manager, on=3)
    # its server restarted without its memory
    sid = backup.server_id
    state.register_server(sid, f"h{sid[1:]}", backup.grpc_address, list(backup.endpoints), 64 * MiB, held=[])
    assert state.get_region("job/r").state == "degraded"     # not lost: the primary lives
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready" and backup.extent_id not in after.extent_ids
    assert {c.server_id for c in after.copies_of(0)} == {"s0", "s1", "s2"} - {sid}


def test_a_server_that_registers_again_is_resynced(state, servers, manager) -> None:
    region, primary, backup = two_copies(state, servers, manager)
    # a restart with its (persistent) extents: its replica settings are gone
    state.register_server(backup.server_id, "h", backup.grpc_address, [], 64 * MiB,
                          held=[HeldExtent(backup.extent_id, region.uid, MiB, 1.0)], now=2e9)
    settle(manager, 2)
    after = state.get_region("job/r")
    assert after.state == "ready" and roles(after) == roles(region)
    assert manager.metrics.by_kind == {"drop": 1, "resync": 1}


def test_no_live_copy_to_promote_waits(state, servers, manager) -> None:
    add_servers(state, 2)
    region = create(state, servers)
    settle(manager)
    for e in region.copies_of(0):
        kill(state, servers, e.server_id)
    servers.calls.clear()
    settle(manager, 2)
    assert servers.calls == []
    after = state.get_region("job/r")
    assert after.state == "degraded" and roles(after) == roles(region)


def test_a_failed_sync_is_driven_again_at_a_fresh_view(state, servers, manager, clock) -> None:
    region, primary, backup = two_copies(state, servers, manager, on=3)
    kill(state, servers, backup.server_id)
    servers.sync_fails_once = errors.ServerUnavailable("the primary went away mid-copy")
    settle(manager)
    (syncing,) = state.get_region("job/r").others()
    assert syncing.role == "syncing" and state.get_region("job/r").state == "degraded"
    settle(manager)                       # waits RETRY_SECONDS
    assert state.get_region("job/r").others()[0].role == "syncing"
    clock.now += RETRY_SECONDS + 1
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    (done,) = after.others()
    assert done.extent_id == syncing.extent_id and done.view > syncing.view + 1
    assert manager.metrics.by_kind == {"drop": 1, "redrive": 1}


def test_a_syncing_copy_recorded_before_a_crash_is_reserved_and_synced(state, servers, clock) -> None:
    region, primary, backup, spare = with_a_spare(state, servers)
    kill(state, servers, backup.server_id)
    # what a controller did before it died: the backup fenced, a copy recorded on the
    # spare (not reserved, nothing configured)
    state.change_slot("job/r", region.uid, SlotChange(0, 1, {1: "stale"}))
    state.change_slot("job/r", region.uid, SlotChange(0, 2, add=NewCopy(2, spare)))
    manager = RepairManager(state, servers, clock=clock)
    try:
        settle(manager)
    finally:
        manager.close()
    after = state.get_region("job/r")
    assert after.state == "ready" and roles(after) == [(primary.server_id, "primary"), (spare, "backup")]
    (new,) = after.others()
    assert new.extent_id in servers.held[new.grpc_address]
    assert servers.config[new.extent_id][0] >= 4 and servers.config[primary.extent_id][0] >= 4


def test_a_spare_that_cannot_take_the_copy_is_avoided(state, servers, manager, clock) -> None:
    region, primary, backup = two_copies(state, servers, manager, on=4)
    spares = sorted({"s0", "s1", "s2", "s3"} - {primary.server_id, backup.server_id})
    kill(state, servers, backup.server_id)
    for sid in spares:    # the first one tried fails
        servers.fail_once[f"mem{sid[1:]}:1"] = errors.OutOfMemory("full")
    settle(manager)
    assert state.get_region("job/r").state == "degraded"
    clock.now += RETRY_SECONDS + 1
    servers.fail_once.clear()
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"


def test_plan_fence_on_a_healthy_slot_is_nothing(state, servers) -> None:
    add_servers(state, 2)
    region = create(state, servers)
    assert plan_fence(region, 0) is None


def test_spares_of_one_pass_count_what_earlier_slots_took(state, servers, manager) -> None:
    add_servers(state, 2)
    (region,) = create_all(state, servers, CreateRequest("job/r", 2 * MiB, stripe_unit=MiB, replicas=2))
    state.register_server("s2", "h2", "mem2:1", [], 3 * MiB // 2)
    state.register_server("s3", "h3", "mem3:1", [], 5 * MiB // 4)
    settle(manager)
    kill(state, servers, "s0")
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    placed = sorted(c.server_id for c in after.extents)
    assert placed == ["s1", "s1", "s2", "s3"]       # one new copy on each spare, not both on s2
    assert len(region.extents) == len(after.extents) == 4
    assert all(s.used <= s.capacity for s in state.list_servers())


# -- backups a primary reports it cannot reach (its server and theirs both heartbeat) ----
def report(copy_of_primary: ExtentRecord, backup: ExtentRecord, view: int = 1,
           server_id: str | None = None) -> FailedReplica:
    return FailedReplica(server_id or copy_of_primary.server_id, copy_of_primary.extent_id,
                         backup.extent_id, view, "silent for 3 s")


def test_a_reported_backup_is_dropped_and_repaired_onto_a_spare(state, servers, manager) -> None:
    region, primary, backup, spare = with_a_spare(state, servers)
    settle(manager)
    servers.configured.clear()
    manager.report([report(primary, backup)])
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    assert roles(after) == [(primary.server_id, "primary"), (spare, "backup")]
    # the primary is configured without the backup first (that answers the waiting
    # mutations), then the spare is synced; the stale copy is released on its server
    seq = [(eid, view, role, bs) for _, eid, view, role, bs in servers.configured]
    assert seq[0] == (primary.extent_id, 2, "primary", [])
    (new,) = after.others()
    assert (primary.extent_id, 3, "primary", [(new.extent_id, True)]) in seq
    assert backup.extent_id not in servers.held[backup.grpc_address]
    assert manager.metrics.by_kind == {"unreachable": 1, "spare": 1}


def test_a_reported_backup_without_a_spare_is_resynced_after_the_avoid_time(
        state, servers, manager, clock) -> None:
    region, primary, backup = two_copies(state, servers, manager)
    manager.report([report(primary, backup)])
    settle(manager, 3)
    after = state.get_region("job/r")
    assert after.state == "degraded"
    assert roles(after) == [(primary.server_id, "primary"), (backup.server_id, "stale")]
    clock.now += RETRY_SECONDS + 1
    settle(manager, 2)                                  # still avoided: no resync hot loop
    assert roles(state.get_region("job/r"))[1] == (backup.server_id, "stale")
    clock.now += AVOID_SECONDS
    settle(manager)
    after = state.get_region("job/r")
    assert after.state == "ready" and roles(after) == roles(region)
    assert manager.metrics.by_kind == {"unreachable": 1, "resync": 1}
    # the partition is still there: the primary reports the copy again at the slot's
    # view, and it is stale again
    view = after.view_of(0)
    manager.report([report(primary, backup, view)])
    settle(manager)
    assert roles(state.get_region("job/r"))[1] == (backup.server_id, "stale")
    assert state.get_region("job/r").view_of(0) == view + 1


@pytest.mark.parametrize("case", ["from a backup", "an old view", "a future view", "unknown extent"])
def test_a_report_not_from_the_primary_at_its_view_is_ignored(state, servers, manager, case) -> None:
    add_servers(state, 3)
    region = create(state, servers, replicas=3)
    primary, b1, b2 = region.copies_of(0)
    settle(manager)
    state.change_slot("job/r", region.uid, SlotChange(0, 1))     # the slot is at view 2 now
    settle(manager)
    servers.configured.clear()
    bad = {"from a backup": FailedReplica(b1.server_id, b1.extent_id, b2.extent_id, 2),
           "an old view": report(primary, b1, view=1),
           "a future view": report(primary, b1, view=3),
           "unknown extent": FailedReplica(primary.server_id, 999, b1.extent_id, 2)}[case]
    manager.report([bad])
    settle(manager, 2)
    after = state.get_region("job/r")
    assert after.state == "ready" and after.view_of(0) == 2 and roles(after) == roles(region)
    assert servers.configured == [] and manager.metrics.by_kind == {}


def test_a_deposed_primary_cannot_drop_a_healthy_backup(state, servers, manager) -> None:
    _, primary, _, b2 = with_a_dead_primary_of_three(state, servers, manager)
    settle(manager, 3)                                   # b1 leads, b2 resynced, a new copy
    before = state.get_region("job/r")
    assert before.state == "ready"
    # the old primary, back from a pause, still thinks it leads at view 1
    servers.dead.clear()
    state.heartbeat(primary.server_id, [])
    manager.report([report(primary, b2, view=1)])
    settle(manager)
    after = state.get_region("job/r")
    assert roles(after) == roles(before) and after.view_of(0) == before.view_of(0)


def test_a_report_for_a_copy_already_stale_is_a_no_op(state, servers, manager) -> None:
    _, primary, backup = with_a_dead_backup(state, servers, manager)
    after = state.get_region("job/r")
    assert roles(after)[1] == (backup.server_id, "stale") and after.view_of(0) == 2
    servers.configured.clear()
    manager.report([report(primary, backup, view=2)])
    settle(manager)
    assert state.get_region("job/r").view_of(0) == 2
    assert servers.configured == [] and manager.metrics.by_kind == {"drop": 1}
