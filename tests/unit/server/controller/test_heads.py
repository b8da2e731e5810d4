"""Evening each region's primaries (heads) out: the pure rule
:func:`smb_server.controller.heads.plan_heads` on store shapes built as records, and the
repair manager's role swaps and graceful handovers (the old primary drained first, so
the copies that stay are not copied again) against the in-memory servers of the repair
tests and a real SQLite ControllerState."""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from smb_protocol import errors
from smb_protocol.replicas import ReplicaRole
from smb_server.controller.heads import Swap, head_cap, plan_heads
from smb_server.controller.memservers import Backup
from smb_server.controller.moves import head_bytes, head_of, plan_rebalance
from smb_server.controller.rebalancer import Rebalancer
from smb_server.controller.records import CreateRequest, ExtentRecord, RegionRecord, ServerRecord, SlotChange
from smb_server.controller.repair import RepairManager
from smb_server.controller.stores.sqlite.state import ControllerState
from tests.unit.server.controller.test_moves import add_servers_more, rebalance_all
from tests.unit.server.controller.test_repair import MiB, ReplicaServers, add_servers, create_all, settle

SLOT = 4 * MiB
_ids = itertools.count(1)


# -- store shapes as records ------------------------------------------------------------

def server(sid: str, state: str = "up", evacuating: bool = False) -> ServerRecord:
    return ServerRecord(sid, f"h{sid}", f"{sid}:1", (f"tcp://{sid}:2",), 256 * MiB, 0, 0, state, 0.0, 0.0,
                        evacuating)


def region(name: str, slots: Sequence[Sequence[str]], length: int = SLOT, placement: str = "striped",
           roles: dict[tuple[int, int], str] | None = None,
           states: dict[str, str] | None = None) -> RegionRecord:
    """A ready region whose slot ``i`` has a copy on each server of ``slots[i]``, the
    first the primary; ``roles``: (slot, copy) -> another role; ``states``: server states."""
    extents = []
    for index, holders in enumerate(slots):
        for copy, sid in enumerate(holders):
            role = (roles or {}).get((index, copy), ReplicaRole.PRIMARY if copy == 0 else ReplicaRole.BACKUP)
            extents.append(ExtentRecord(next(_ids), index, sid, length, server_state=(states or {}).get(sid, "up"),
                                        copy=copy, role=ReplicaRole(role), view=1))
    return RegionRecord(name, hashlib.md5(name.encode()).hexdigest(), len(slots) * length, placement,
                        length, (), (), False, 0.0, "ready", tuple(extents), len(slots[0]))


def swapped(regions: Sequence[RegionRecord], swaps: Sequence[Swap]) -> dict[str, list[str]]:
    """Each region's head per slot once ``swaps`` are made (checking each is a swap
    from the slot's primary to one of its backups)."""
    out = {}
    for r in regions:
        heads = [head_of(r.copies_of(i)) for i in range(r.slots)]
        names = []
        for i, head in enumerate(heads):
            assert head is not None
            mine = [s for s in swaps if (s.region, s.index) == (r.name, i)]
            assert len(mine) <= 1, mine                     # a slot swaps once at most
            if mine:
                (s,) = mine
                new = next(c for c in r.copies_of(i) if c.extent_id == s.extent_id)
                assert (s.source, s.target, new.server_id, new.role) == (head.server_id, new.server_id,
                                                                         s.target, "backup")
                names.append(s.target)
            else:
                names.append(head.server_id)
        out[r.name] = names
    return out


def per_server(heads: dict[str, list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for names in heads.values():
        for sid in names:
            out[sid] = out.get(sid, 0) + 1
    return out


# -- the rule -----------------------------------------------------------------------------
def test_the_measured_shape_gets_one_head_per_server_in_each_region_by_two_swaps() -> None:
    """Two striped regions of 4 slots, 2 copies, after an evacuation and a rebalance onto a
    5th server: bytes even (4 copies per server), but job/a headed twice by s1 and job/b
    twice by s2, so s4 heads 1 slot and s1 and s2 3."""
    servers = [server("s0", "draining", evacuating=True)] + [server(f"s{i}") for i in range(1, 5)]
    regions = [region("job/a", [("s1", "s2"), ("s1", "s4"), ("s4", "s3"), ("s3", "s2")]),
               region("job/b", [("s2", "s1"), ("s1", "s3"), ("s2", "s4"), ("s3", "s4")])]
    assert plan_rebalance(servers, regions) == []          # the bytes are even: no move helps
    swaps = plan_heads(servers, regions)
    assert len(swaps) == 2
    heads = swapped(regions, swaps)
    for names in heads.values():
        assert max(names.count(s) for s in names) <= head_cap(4, 4)
    assert per_server(heads) == {"s1": 2, "s2": 2, "s3": 2, "s4": 2}
    assert plan_heads(servers, [_apply(r, swaps) for r in regions]) == []   # settled


def _apply(r: RegionRecord, swaps: Sequence[Swap]) -> RegionRecord:
    """``r`` once ``swaps`` are made (roles only)."""
    targets = {s.extent_id for s in swaps if s.region == r.name}
    slots = {c.index for c in r.extents if c.extent_id in targets}
    extents = []
    for e in r.extents:
        role = e.role
        if e.index in slots:
            role = ReplicaRole.PRIMARY if e.extent_id in targets else ReplicaRole.BACKUP
        extents.append(ExtentRecord(e.extent_id, e.index, e.server_id, e.length, server_state=e.server_state,
                                    copy=e.copy, role=role, view=e.view + 2))
    return RegionRecord(r.name, r.uid, r.size, r.placement, r.stripe_unit, (), (), False, 0.0, r.state,
                        tuple(extents), r.replicas)


def test_a_chain_of_swaps_moves_a_head_where_no_single_swap_can() -> None:
    """s0 heads two slots whose backups are on s1; s1's own slot has its backup on s2,
    which heads nothing: s0 hands one to s1, s1 hands its own on to s2."""
    servers = [server("s0"), server("s1"), server("s2")]
    r = region("job/a", [("s0", "s1"), ("s0", "s1"), ("s1", "s2")])
    swaps = plan_heads(servers, [r])
    assert len(swaps) == 2
    assert sorted(swapped([r], swaps)["job/a"]) == ["s0", "s1", "s2"]


def test_heads_even_across_regions_once_each_region_is_even() -> None:
    """Each region heads one slot per server at most already, but s0 and s1 head every
    slot of both regions: swaps give s2 and s3 their share of the bytes headed."""
    servers = [server(f"s{i}") for i in range(4)]
    regions = [region("job/a", [("s0", "s2"), ("s1", "s3")]), region("job/b", [("s0", "s2"), ("s1", "s3")])]
    swaps = plan_heads(servers, regions)
    assert per_server(swapped(regions, swaps)) == {"s0": 1, "s1": 1, "s2": 1, "s3": 1}


def test_even_heads_and_small_slots_stay_where_they_are() -> None:
    servers = [server(f"s{i}") for i in range(4)]
    even = region("job/a", [("s0", "s1"), ("s1", "s2"), ("s2", "s3"), ("s3", "s0")])
    assert plan_heads(servers, [even]) == []
    # a 4 KB region is not worth a handover to narrow a gap of megabytes (here headed by
    # an unreplicated region, which only a move of bytes evens out)
    big = region("job/big", [("s0",), ("s0",)])
    small = region("job/small", [("s0", "s1")], length=4096, placement="single")
    assert plan_heads(servers, [big, small]) == []


def test_only_slots_in_step_swap_and_only_to_backups_on_servers_that_are_up() -> None:
    servers = [server("s0"), server("s1"), server("s2", "draining"), server("s3", "down")]
    r = region("job/a", [("s0", "s1"), ("s0", "s1", "s2"), ("s0", "s2"), ("s0", "s3"), ("s0", "s1")],
               roles={(0, 1): "syncing"}, states={"s2": "draining", "s3": "down"})
    swaps = plan_heads(servers, [r])
    # slot 0 is being synced, slots 2 and 3 have their backups on servers that are not up
    assert {(s.index, s.target) for s in swaps} <= {(1, "s1"), (4, "s1")}
    assert len(swaps) == 2


def test_a_region_whose_copies_sit_on_two_servers_is_even_over_those_two() -> None:
    servers = [server(f"s{i}") for i in range(4)]
    r = region("job/a", [("s0", "s1")] * 4)
    assert sorted(swapped([r], plan_heads(servers, [r]))["job/a"]) == ["s0", "s0", "s1", "s1"]


def test_a_rebalance_with_even_bytes_swaps_roles_and_is_done_once_they_are_made() -> None:
    servers = [server(f"s{i}") for i in range(2)]
    before = [region("job/a", [("s0", "s1"), ("s0", "s1")])]
    r = Rebalancer()
    r.start(bytes_per_second=0, now=0.0)
    assert r.update(before, servers, now=0.0) == {}         # nothing to copy
    (swap,) = r.swapping().values()
    assert r.running()
    assert r.update(before, servers, now=1.0) == {} and r.swapping() == {swap.extent_id: swap}
    after = [_apply(before[0], [swap])]
    r.update(after, servers, now=2.0)
    assert r.swapping() == {} and r.swapped == 1
    r.update(after, servers, now=3.0)
    assert not r.running()


# -- the repair manager ----------------------------------------------------------------------
class DrainRefused(ReplicaServers):
    """A memory server that answers a primary's demotion as one whose backup failed
    would (the change holds, the call raises); once per extent."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[int] = []

    def configure_replicas(self, address: str, region_uid: str, extent: ExtentRecord, view: int,
                           role: str, backups: Sequence[Backup] = ()) -> tuple[int, int]:
        was = self.config.get(extent.extent_id)
        got = super().configure_replicas(address, region_uid, extent, view, role, backups)
        if was is not None and was[1] == "primary" and role == "backup" and extent.extent_id not in self.refused:
            self.refused.append(extent.extent_id)
            raise errors.ServerUnavailable(f"extent {extent.extent_id}: backup 9 failed: copy it again")
        return got


def two_slots_headed_by_s0(state: ControllerState, servers: ReplicaServers, manager: RepairManager) -> RegionRecord:
    """A striped region of two 1 MiB slots, two copies each on s0 and s1, both headed by
    s0 (as a handover may leave them), its views pushed."""
    add_servers(state, 2, capacity=256 * MiB)
    (created,) = create_all(state, servers, CreateRequest("job/a", 2 * MiB, stripe_unit=MiB, replicas=2))
    for index in range(2):
        head = head_of(created.copies_of(index))
        assert head is not None
        if head.server_id != "s0":
            other = next(c for c in created.copies_of(index) if c.copy != head.copy)
            state.change_slot("job/a", created.uid, SlotChange(index, 1, {head.copy: "backup", other.copy: "primary"}))
    settle(manager)
    servers.configured.clear()
    r = state.get_region("job/a")
    assert head_bytes([r]) == {"s0": 2 * MiB}
    return r


def test_a_role_swap_drains_the_old_primary_first_and_copies_nothing(state, servers, manager, clock) -> None:
    before = two_slots_headed_by_s0(state, servers, manager)
    rebalance_all(manager, clock)
    after = state.get_region("job/a")
    assert head_bytes([after]) == {"s0": MiB, "s1": MiB} and after.state == "ready"
    assert servers.synced_bytes == 0 and manager.metrics.moved_bytes == 0
    assert manager.metrics.by_kind == {"swap": 1, "drained": 1}
    (index,) = [i for i in range(2) if head_of(after.copies_of(i)).server_id == "s1"]   # type: ignore[union-attr]
    old = head_of(before.copies_of(index))
    new = head_of(after.copies_of(index))
    assert old is not None and new is not None
    view = before.view_of(index)
    seq = [(eid, v, role, bs) for _, eid, v, role, bs in servers.configured]
    # the old primary is made a backup first (drained), then at the next view the backups,
    # the new primary last with its backups live
    assert seq == [(old.extent_id, view + 1, "backup", []),
                   (old.extent_id, view + 2, "backup", []),
                   (new.extent_id, view + 2, "primary", [(old.extent_id, False)])]
    assert roles_of(after, index) == {old.extent_id: "backup", new.extent_id: "primary"}


def roles_of(r: RegionRecord, index: int) -> dict[int, str]:
    return {c.extent_id: str(c.role) for c in r.copies_of(index)}


def test_a_swap_whose_old_primary_was_not_drained_copies_the_staying_copy_again(state, clock) -> None:
    servers = DrainRefused()
    manager = RepairManager(state, servers, sync_workers=2, clock=clock)
    try:
        two_slots_headed_by_s0(state, servers, manager)
        rebalance_all(manager, clock)
        after = state.get_region("job/a")
        assert head_bytes([after]) == {"s0": MiB, "s1": MiB} and after.state == "ready"
        assert servers.refused and servers.synced_bytes == MiB      # the old primary copied again
        assert manager.metrics.by_kind == {"swap": 1, "redrive": 1}
    finally:
        manager.close()


def test_the_issues_scenario_gets_even_heads_and_one_copy_per_moved_copy(state, servers, manager, clock) -> None:
    """Two striped regions of 4 slots, 2 copies, on 4 servers; one evacuated, a 5th
    joins, a rebalance: each region heads one slot per live server, every server heads
    two, and every byte copied is a copy that moved (no staying copy synced again)."""
    add_servers(state, 4, capacity=256 * MiB)
    create_all(state, servers, *(CreateRequest(name, 4 * SLOT, stripe_unit=SLOT, replicas=2)
                                 for name in ("job/a", "job/b")))
    settle(manager)
    state.drain("s0", evacuate=True)
    settle(manager, 12)
    assert state.get_server("s0").extents == 0
    add_servers_more(state, 1)
    rebalance_all(manager, clock)
    regions = state.list_regions()
    live = [s.server_id for s in state.list_servers() if s.state == "up"]
    assert len(live) == 4
    for r in regions:
        assert r.state == "ready"
        heads = [head_of(r.copies_of(i)).server_id for i in range(r.slots)]   # type: ignore[union-attr]
        assert sorted(heads) == sorted(live), (r.name, heads)
    assert head_bytes(regions) == {sid: 2 * SLOT for sid in live}
    used = {s.server_id: s.used for s in state.list_servers() if s.state == "up"}
    assert set(used.values()) == {4 * SLOT}
    assert "redrive" not in manager.metrics.by_kind and "resync" not in manager.metrics.by_kind
    assert servers.synced_bytes == manager.metrics.moved_bytes
