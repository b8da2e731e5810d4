"""Moves of copies between servers (evacuation, rebalance): the pure rules of
:mod:`smb_server.controller.moves` and the repair manager's sequences for them, against
the in-memory servers of the repair tests and a real SQLite ControllerState."""
from __future__ import annotations

import dataclasses

import pytest

from smb_protocol import errors
from smb_server.controller.moves import head_bytes, head_of, leaving, plan_rebalance
from smb_server.controller.rebalancer import Rebalancer
from smb_server.controller.records import CreateRequest, ExtentRecord, NewCopy, SlotChange
from smb_server.controller.repair import RETRY_SECONDS, RepairManager, RepairMetrics
from smb_server.controller.stores.sqlite.state import ControllerState
from smb_server.runtime.metrics import Registry
from tests.unit.server.controller.test_repair import (
    MiB,
    add_servers,
    create,
    create_all,
    kill,
    roles,
    settle,
    with_a_spare,
)


def servers_by_id(state: ControllerState) -> dict:
    return {s.server_id: s for s in state.list_servers()}


def evacuate_all(manager: RepairManager, passes: int = 6) -> None:
    settle(manager, passes)


# -- the rules -----------------------------------------------------------------------------
def test_an_evacuating_servers_copies_leave_and_extra_copies_on_the_fullest_servers_go(state, servers) -> None:
    region, primary, backup, spare = with_a_spare(state, servers)
    assert leaving(region, 0, servers_by_id(state)) == frozenset()
    state.drain(backup.server_id, evacuate=True)
    assert leaving(region, 0, servers_by_id(state)) == {backup.copy}
    assert leaving(region, 0, servers_by_id(state), {primary.extent_id: "s9"}) == {primary.copy, backup.copy}
    state.drain(backup.server_id, undrain=True)
    # a third in-step copy (a move's, its old copy not dropped yet): the fullest server's goes
    result = state.change_slot("job/r", region.uid, SlotChange(0, 1, add=NewCopy(2, spare, "backup")))
    assert result is not None
    after = result[0]
    by_id = servers_by_id(state)
    gone = leaving(after, 0, by_id)
    assert len(gone) == 1
    (copy,) = gone
    fullest = max(by_id[c.server_id].used for c in after.copies_of(0))
    assert by_id[next(c.server_id for c in after.copies_of(0) if c.copy == copy)].used == fullest


def test_drain_flags_exclude_each_other_and_removal_needs_an_empty_drained_server(state, servers) -> None:
    add_servers(state, 2)
    with pytest.raises(errors.InvalidArgument, match="exclude"):
        state.drain("s0", undrain=True, evacuate=True)
    assert state.drain("s0", evacuate=True).evacuating
    assert state.get_server("s0").state == "draining"
    assert not state.drain("s0").evacuating          # a plain drain keeps the copies where they are
    with pytest.raises(errors.InvalidArgument, match="drain it first"):
        state.remove_server("s1")
    create(state, servers, replicas=1)
    holder = state.get_region("job/r").extents[0].server_id
    state.drain(holder)
    with pytest.raises(errors.InvalidArgument, match="evacuate it first"):
        state.remove_server(holder)
    other = ({"s0", "s1"} - {holder}).pop()
    state.drain(other)
    assert state.remove_server(other).server_id == other
    assert other not in servers_by_id(state)
    with pytest.raises(errors.ServerNotFound):
        state.remove_server(other)


def test_a_rebalance_evens_bytes_out_and_spreads_a_striped_regions_slots(state, servers) -> None:
    add_servers(state, 2, capacity=256 * MiB)
    create_all(state, servers, CreateRequest("job/a", 8 * MiB, stripe_unit=MiB),
               CreateRequest("job/b", 4 * MiB, stripe_unit=MiB))
    add_servers_more(state, 2)
    moves = plan_rebalance(state.list_servers(), state.list_regions())
    used = {s.server_id: s.used for s in state.list_servers()}
    for m in moves:
        used[m.source] -= m.length
        used[m.target] += m.length
    assert max(used.values()) - min(used.values()) <= 2 * MiB   # within one copy of even
    assert {m.target for m in moves} == {"s2", "s3"}
    # each region ends with slots on every server
    a_moves = [m for m in moves if m.region == "job/a"]
    assert {m.target for m in a_moves} == {"s2", "s3"}
    assert plan_rebalance(state.list_servers(), state.list_regions(), limit=1) == moves[:1]


def add_servers_more(state: ControllerState, n: int) -> None:
    have = len(state.list_servers())
    for i in range(have, have + n):
        state.register_server(f"s{i}", f"h{i}", f"mem{i}:1", [f"tcp://mem{i}:2"], 256 * MiB)


def test_a_rebalance_paces_its_moves_by_the_rate(state, servers) -> None:
    r = Rebalancer()
    add_servers(state, 1, capacity=256 * MiB)
    create_all(state, servers, *(CreateRequest(f"job/{k}", MiB, placement="single") for k in range(4)))
    add_servers_more(state, 1)
    r.start(bytes_per_second=MiB, now=0.0)
    first = r.update(state.list_regions(), state.list_servers(), now=0.0)
    assert len(first) == 1 and r.running()
    # the move is done once its extent left the store; the next one waits a second per MiB
    (eid,) = first
    done = [dataclasses.replace(r2, extents=tuple(e for e in r2.extents if e.extent_id != eid))
            for r2 in state.list_regions()]
    assert r.update(done, state.list_servers(), now=0.5) == {}
    assert r.moved == MiB
    assert r.update(state.list_regions(), state.list_servers(), now=0.9) == {}   # not due yet
    assert len(r.update(state.list_regions(), state.list_servers(), now=1.01)) == 1
    r.stop()
    r.forget()
    assert not r.running()


# -- the repair manager's sequences ---------------------------------------------------------
def test_an_unreplicated_extent_moves_through_a_replica_set_of_two(state, servers, manager) -> None:
    add_servers(state, 2)
    region = create(state, servers, replicas=1)
    (source,) = region.copies_of(0)
    target = ({"s0", "s1"} - {source.server_id}).pop()
    settle(manager)
    assert servers.configured == []           # nothing moves while nobody evacuates
    state.drain(source.server_id, evacuate=True)
    evacuate_all(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    assert roles(after) == [(target, "primary")]
    (new,) = after.copies_of(0)
    seq = [(eid, view, role, bs) for _, eid, view, role, bs in servers.configured]
    # the new copy is a backup, the source a primary that copies to it while clients write,
    # then the new copy serves alone, unreplicated again; the source's extent is released
    assert seq[0] == (new.extent_id, 1, "backup", [])
    assert seq[1] == (source.extent_id, 1, "primary", [(new.extent_id, True)])
    assert (new.extent_id, after.view_of(0), "", []) == seq[-1]
    assert source.extent_id in servers.released
    assert state.get_server(source.server_id).extents == 0
    assert manager.metrics.moved_bytes == MiB
    assert manager.metrics.by_kind == {"spare": 1, "handover": 1}


def test_an_evacuated_primary_is_replaced_by_a_copy_that_stays(state, servers, manager) -> None:
    _, primary, backup, spare = with_a_spare(state, servers)
    settle(manager)
    state.drain(primary.server_id, evacuate=True)
    evacuate_all(manager)
    after = state.get_region("job/r")
    assert after.state == "ready"
    assert sorted(roles(after)) == sorted([(backup.server_id, "primary"), (spare, "backup")])
    assert primary.extent_id in servers.released
    # the old primary was fenced by its backups' new view before the new primary took over
    assert "handover" in manager.metrics.by_kind


def evacuated_and_cut_mid_copy(state: ControllerState, servers, manager: RepairManager, why: str) -> ExtentRecord:
    """A region of one copy on three servers whose server is evacuated; the sync of the
    copy that is to replace it fails (ServerUnavailable ``why``) in the repair pass run
    here. Returns the source copy."""
    add_servers(state, 3)
    region = create(state, servers, replicas=1)
    (source,) = region.copies_of(0)
    state.drain(source.server_id, evacuate=True)
    servers.sync_fails_once = errors.ServerUnavailable(why)
    manager.run_pass()
    manager.wait(10)
    return source


def test_a_target_that_dies_mid_copy_is_replaced_by_another(state, servers, manager, clock) -> None:
    source = evacuated_and_cut_mid_copy(state, servers, manager, "the target died mid-copy")
    mid = state.get_region("job/r")
    (target,) = [c for c in mid.copies_of(0) if c.role == "syncing"]
    kill(state, servers, target.server_id)
    settle(manager)
    # the source serves alone again, unreplicated, until the next try
    assert servers.config[source.extent_id][1] == ""
    clock.now += RETRY_SECONDS + 1
    evacuate_all(manager, 8)
    after = state.get_region("job/r")
    (moved,) = after.copies_of(0)
    assert moved.server_id not in (source.server_id, target.server_id)
    assert after.state == "ready"


def test_a_new_leader_finishes_a_move_whose_copy_is_in_step(state, servers, clock) -> None:
    add_servers(state, 2)
    region = create(state, servers, replicas=1)
    (source,) = region.copies_of(0)
    target = ({"s0", "s1"} - {source.server_id}).pop()
    # a leader picked a move and synced the copy, then died before dropping the source
    state.change_slot("job/r", region.uid, SlotChange(0, 0, {0: "primary"}, add=NewCopy(1, target, "backup")))
    servers.reserve("mem" + target[1:] + ":1", region.uid, state.get_region("job/r").copies_of(0)[1])
    leader = RepairManager(state, servers, clock=clock)
    try:
        settle(leader, 3)
    finally:
        leader.close()
    after = state.get_region("job/r")
    assert len(after.copies_of(0)) == 1                # over-replication: one copy goes
    assert after.state == "ready"


def test_a_source_that_dies_mid_move_follows_the_usual_rules(state, servers, manager) -> None:
    source = evacuated_and_cut_mid_copy(state, servers, manager, "the source died mid-copy")
    kill(state, servers, source.server_id)
    evacuate_all(manager, 4)
    after = state.get_region("job/r")
    assert after.state == "degraded"     # served again if the source comes back with its memory
    assert after.primaries()[0].extent_id == source.extent_id


def test_moves_show_in_the_controllers_metrics(state, servers, clock) -> None:
    registry = Registry()
    manager = RepairManager(state, servers, metrics=RepairMetrics(registry), clock=clock)
    try:
        add_servers(state, 2)
        region = create(state, servers, replicas=1)
        state.drain(region.copies_of(0)[0].server_id, evacuate=True)
        manager.run_pass()                      # the pass that starts the move sees what is left
        assert "smb_controller_move_bytes_left 1.048576e+06" in registry.render()
        manager.wait(10)
        settle(manager, 3)
        text = registry.render()
        assert "smb_controller_move_bytes_left 0.0" in text
        assert "smb_controller_moved_bytes_total 1.048576e+06" in text
    finally:
        manager.close()


def striped_on_three(state: ControllerState, servers) -> None:
    """Three regions of three 1 MiB slots with two copies each on s0-s2 (each server
    heads three slots and holds 6 MiB), then a spare s3."""
    add_servers(state, 3, capacity=256 * MiB)
    create_all(state, servers, *(CreateRequest(f"job/{k}", 3 * MiB, stripe_unit=MiB, num_servers=3, replicas=2)
                                 for k in range(3)))
    assert sorted(head_bytes(state.list_regions()).values()) == [3 * MiB] * 3
    add_servers_more(state, 1)


def test_an_evacuation_hands_the_leaving_primaries_to_the_server_heading_the_least(state, servers, manager) -> None:
    """The server that took the evacuated copies heads its share of the slots (their
    reads and mutations), not only backups."""
    striped_on_three(state, servers)
    settle(manager)
    state.drain("s0", evacuate=True)
    evacuate_all(manager, 10)
    heads = head_bytes(state.list_regions())
    assert state.get_server("s0").extents == 0
    assert heads == {"s1": 3 * MiB, "s2": 3 * MiB, "s3": 3 * MiB}


def rebalance_all(manager: RepairManager, clock) -> None:
    """Start a rebalance (no rate limit) and run repair passes until it is done."""
    settle(manager)
    manager.moves.start(bytes_per_second=0, now=clock())
    for _ in range(40):
        settle(manager)
        if not manager.moves.running():
            break
    assert not manager.moves.running()


def test_a_rebalance_onto_a_new_server_spreads_the_primaries_too(state, servers, manager, clock) -> None:
    striped_on_three(state, servers)
    rebalance_all(manager, clock)
    used = {s.server_id: s.used for s in state.list_servers()}
    assert max(used.values()) - min(used.values()) <= MiB
    assert manager.metrics.moved_bytes == used["s3"]     # every copy the empty server got was moved
    heads = head_bytes(state.list_regions())
    assert heads.get("s3", 0) >= MiB and max(heads.values()) - min(heads.values()) <= MiB, heads


def test_a_rebalance_keeps_a_small_striped_region_spread(state, servers, manager, clock) -> None:
    """The elastic benchmark's SEASGD store: global weights (three small slots, read by
    every worker) and deltas (three big slots), two copies each on s0-s2. Evening the
    bytes out onto a fourth server must not gather the weights' copies onto fewer
    servers: their reads would then share fewer links."""
    add_servers(state, 3, capacity=256 * MiB)
    create_all(state, servers, CreateRequest("job/params", 4505664, stripe_unit=MiB, num_servers=3, replicas=2),
               CreateRequest("job/deltas", 4 * 4505664, stripe_unit=MiB, num_servers=3, replicas=2),
               *(CreateRequest(small, 4096, placement="single", replicas=2) for small in ("job/counters", "job/meta")))
    small_before = {r.name: sorted(c.server_id for c in r.extents) for r in state.list_regions()
                    if r.size == 4096}
    add_servers_more(state, 1)
    rebalance_all(manager, clock)
    used = {s.server_id: s.used for s in state.list_servers()}
    assert used["s3"] > 0
    # 4 KB copies are not worth a sync (and a handover) to narrow a gap of megabytes
    assert {r.name: sorted(c.server_id for c in r.extents) for r in state.list_regions()
            if r.size == 4096} == small_before
    for region in state.list_regions():
        copies = [c.server_id for c in region.extents]
        per_server = {sid: copies.count(sid) for sid in used}
        cap = -(-len(copies) // len(used))     # 6 copies on 4 servers: at most 2 each
        assert max(per_server.values()) <= cap, (region.name, per_server)
        heads = [head_of(region.copies_of(i)).server_id for i in sorted({e.index for e in region.extents})]
        assert len(set(heads)) == len(heads), (region.name, heads)   # each slot headed elsewhere


def test_many_small_regions_still_even_out(state, servers) -> None:
    """Copies each far below the gap move where together they close it."""
    small = 4096
    add_servers(state, 3, capacity=256 * MiB)
    create_all(state, servers, *(CreateRequest(f"job/small-{k}", small, placement="single") for k in range(240)))
    add_servers_more(state, 1)
    used = {s.server_id: s.used for s in state.list_servers()}
    assert used["s3"] == 0 and small * 64 < max(used.values())   # each copy below 1/64 of the gap
    for m in plan_rebalance(state.list_servers(), state.list_regions()):
        used[m.source] -= m.length
        used[m.target] += m.length
    assert max(used.values()) - min(used.values()) <= small, used
