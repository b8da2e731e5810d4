"""The controller's rules (smb_server.controller.rules), with no store: records in,
changes out."""
from __future__ import annotations

import pytest

from smb_protocol.errors import InvalidArgument, OutOfMemory, RegionExists, RegionNotFound, ServerNotFound
from smb_protocol.replicas import ReplicaRole as R
from smb_server.controller.records import (
    DELETE_MEMORY_SECONDS,
    CreateRequest,
    DeletedRegion,
    ExtentRecord,
    HeldExtent,
    NewCopy,
    RegionRecord,
    ServerRecord,
    SlotChange,
    check_create,
)
from smb_server.controller.rules import (
    OwnerLease,
    abortable,
    check_committable,
    check_created,
    check_new_region,
    check_registration,
    check_settings,
    delete_memory_horizon,
    drained_state,
    find_server,
    half_created,
    lapsed,
    lease_ran_out,
    leased,
    live_state,
    lost_on_register,
    plan_region,
    refreshed_on_take_over,
    renewed,
    retried_delete,
    slot_change,
)


# -- memory servers -------------------------------------------------------------------------
def test_a_server_comes_back_up_or_draining_by_its_drain_flag() -> None:
    assert live_state(0) == "up"
    assert live_state(1) == "draining"
    assert live_state(2) == "draining"   # evacuating


def test_a_drain_leaves_a_down_server_down() -> None:
    assert drained_state("up", undrain=False) == "draining"
    assert drained_state("draining", undrain=True) == "up"
    assert drained_state("down", undrain=False) == "down"
    assert drained_state("down", undrain=True) == "down"


def test_a_lease_runs_out_after_lease_seconds_of_silence() -> None:
    assert not lease_ran_out("up", 100.0, 105.0, 5.0)          # exactly a lease: still up
    assert lease_ran_out("up", 100.0, 105.5, 5.0)
    assert lease_ran_out("draining", 100.0, 105.5, 5.0)
    assert not lease_ran_out("down", 100.0, 200.0, 5.0)        # marked once


def test_a_take_over_renews_every_live_server_and_no_down_one() -> None:
    assert refreshed_on_take_over("up", 99.0, 100.0)
    assert refreshed_on_take_over("draining", 99.0, 100.0)
    assert not refreshed_on_take_over("up", 100.0, 100.0)      # already current
    assert not refreshed_on_take_over("down", 1.0, 100.0)      # stays down until it calls


def test_a_server_that_registers_without_ready_extents_lost_them() -> None:
    known = {1: ("u1", "ready"), 2: ("u1", "ready"), 3: ("u2", "creating"), 4: ("u3", "ready")}
    held = [HeldExtent(1, "u1"), HeldExtent(4, "u3")]
    assert lost_on_register("s", known, held) == [2]      # 3 is being created: not lost
    assert lost_on_register("s", known, [HeldExtent(e) for e in known]) == []
    assert lost_on_register("s", {}, held) == []


# -- regions ----------------------------------------------------------------------------------
def test_half_created_regions_are_the_ones_still_creating() -> None:
    assert half_created({"b": "creating", "a": "creating", "c": "ready"}) == ["a", "b"]
    assert half_created({"c": "ready"}) == []


def test_a_done_delete_is_remembered_for_an_hour() -> None:
    assert delete_memory_horizon(10_000.0) == 10_000.0 - DELETE_MEMORY_SECONDS


def test_a_retried_delete_is_answered_with_what_it_removed() -> None:
    deleted = DeletedRegion("u" * 32, (("s1", 7, "h:1"),))
    record = deleted.dump("job/x")
    assert retried_delete("job/x", record) == deleted
    assert retried_delete("job/y", record) is None      # the request id deleted another region
    assert retried_delete("job/x", "job/x") == DeletedRegion("")   # an older controller's bare name
    assert retried_delete("job/y", "job/x") is None


# -- replica sets -----------------------------------------------------------------------------
def _region() -> RegionRecord:
    """Two slots of 4096 bytes, each a primary (copy 0) and a backup (copy 1), at view 3."""
    extents = tuple(ExtentRecord(10 * slot + copy, slot, f"s{slot + copy}", 4096, copy=copy,
                                 role=R.PRIMARY if copy == 0 else R.BACKUP, view=3)
                    for slot in (0, 1) for copy in (0, 1))
    return RegionRecord("job/x", "u" * 32, 8192, "striped", 4096, (), (), False, 0.0, "ready", extents, 2)


def test_a_slot_change_promotes_drops_and_adds_at_the_next_view() -> None:
    region = _region()
    change = SlotChange(0, 3, roles={1: R.PRIMARY}, remove=frozenset({0}), add=NewCopy(2, "s9"))
    out = slot_change(region, change, ["s0", "s1", "s9"], new_extent_id=99)
    assert out is not None
    assert [(e.extent_id, e.copy, e.role, e.view) for e in out.kept] == [(1, 1, R.PRIMARY, 4)]
    assert [e.extent_id for e in out.removed] == [0]
    assert out.added == ExtentRecord(99, 0, "s9", 4096, copy=2, role=R.SYNCING, view=4)
    assert [e.copy for e in out.slot] == [1, 2]
    # the other slot is not the change's business
    assert all(e.index == 0 for e in out.slot + out.removed)


def test_a_slot_change_decided_on_an_older_view_is_refused() -> None:
    assert slot_change(_region(), SlotChange(0, 2, roles={1: R.STALE}), ["s0", "s1"]) is None


def test_a_bump_moves_every_copy_to_the_next_view() -> None:
    out = slot_change(_region(), SlotChange(1, 3))
    assert out is not None and out.removed == () and out.added is None
    assert [(e.role, e.view) for e in out.kept] == [(R.PRIMARY, 4), (R.BACKUP, 4)]


def test_a_slot_change_that_does_not_fit_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="two primaries"):
        slot_change(_region(), SlotChange(0, 3, roles={1: R.PRIMARY}))
    with pytest.raises(InvalidArgument, match="no memory server"):
        slot_change(_region(), SlotChange(0, 3, add=NewCopy(2, "s9")), ["s0", "s1"], 99)
    with pytest.raises(ValueError, match="fresh extent id"):
        slot_change(_region(), SlotChange(0, 3, add=NewCopy(2, "s9")))


# -- owner leases -----------------------------------------------------------------------------
def test_an_owner_lease_is_the_longest_of_its_regions() -> None:
    first = leased(None, 10.0, 100.0)
    assert first == OwnerLease(10.0, 110.0)
    assert leased(first, 5.0, 101.0) == OwnerLease(10.0, 110.0)     # a shorter one shortens nothing
    assert leased(first, 30.0, 101.0) == OwnerLease(30.0, 131.0)


def test_a_renewal_extends_a_live_lease_and_not_one_that_ran_out() -> None:
    lease = OwnerLease(10.0, 110.0)
    assert renewed(lease, 105.0) == OwnerLease(10.0, 115.0)
    assert renewed(lease, 110.0) == OwnerLease(10.0, 120.0)          # the last moment still counts
    assert renewed(lease, 110.5) is None
    assert renewed(None, 100.0) is None


def test_a_lapsed_owner_names_its_ready_regions_and_an_idle_one_is_forgotten() -> None:
    owners = {"a": OwnerLease(10.0, 90.0), "b": OwnerLease(10.0, 200.0), "c": OwnerLease(1.0, 50.0)}
    holders = {"job/1": "a", "job/2": "a", "job/3": "b", "job/4": "a"}
    regions, idle = lapsed(owners, holders, ["job/1", "job/2", "job/3"], 100.0)
    assert regions == ["job/1", "job/2"]       # job/4 is not ready (being created): not named
    assert idle == ["c"]                       # a still holds regions; b has not run out


# -- placement --------------------------------------------------------------------------------
def _server(sid: str, state: str = "up", heartbeat: float = 100.0, used: int = 0) -> ServerRecord:
    return ServerRecord(sid, f"host-{sid}", f"{sid}:1", (), 1 << 20, used, 0, state, heartbeat, 0.0)


def test_a_new_region_goes_to_live_servers_only_with_their_free_bytes() -> None:
    servers = [_server("a"), _server("b", state="draining"), _server("c", heartbeat=90.0),
               _server("d", state="down"), _server("e", used=(1 << 20) - 16384)]
    req = check_create(CreateRequest("job/x", 3 * 4096, stripe_unit=4096, replicas=2))
    layout, extents = plan_region(req, servers, now=100.0, lease_seconds=5.0)
    assert {e.server_id for e in extents} == {"a", "e"}     # b drains, c is silent, d is down
    assert [(e.index, e.copy, e.role, e.view) for e in extents][:2] == [(0, 0, R.PRIMARY, 1), (0, 1, R.BACKUP, 1)]
    assert sum(e.length for e in extents) == 2 * layout.size
    with pytest.raises(OutOfMemory):                        # e's free bytes are taken by the batch
        plan_region(req, servers, 100.0, 5.0, taken={"e": 16384})


def test_a_new_region_needs_a_free_name_and_uid() -> None:
    req = check_create(CreateRequest("job/x", 4096))
    check_new_region(req, None, uid_taken=False)
    with pytest.raises(RegionExists, match="being created"):
        check_new_region(req, "creating", uid_taken=False)
    with pytest.raises(RegionExists):
        check_new_region(req, "ready", uid_taken=False)
    with pytest.raises(InvalidArgument, match="uid"):
        check_new_region(req, None, uid_taken=True)


# -- settings, registrations and a region's life -----------------------------------------------
def test_a_store_needs_a_positive_lease_and_no_negative_grace() -> None:
    assert check_settings(5, 0) == (5.0, 0.0)
    with pytest.raises(InvalidArgument, match="lease"):
        check_settings(0, 30)
    with pytest.raises(InvalidArgument, match="grace"):
        check_settings(5, -1)


def test_a_registration_needs_an_address_and_a_byte_count_and_gets_an_id() -> None:
    assert check_registration("s1", "h:1", 4096) == ("s1", 4096)
    drawn, _ = check_registration("", "h:1", 4096)
    assert len(drawn) == 12
    with pytest.raises(InvalidArgument, match="gRPC address"):
        check_registration("s1", "", 4096)
    with pytest.raises(InvalidArgument):
        check_registration("s1", "h:1", -1)
    assert find_server([_server("a"), _server("b")], "b").server_id == "b"
    with pytest.raises(ServerNotFound):
        find_server([_server("a")], "b")


def test_only_a_created_region_is_found() -> None:
    check_created("job/x", "ready")
    check_created("job/x", "lost", "u1", uid="u1")
    for state, uid in ((None, None), ("creating", None)):
        with pytest.raises(RegionNotFound, match="no region named 'job/x'$"):
            check_created("job/x", state, uid)
    with pytest.raises(RegionNotFound, match="uid u2"):
        check_created("job/x", "ready", "u1", uid="u2")


def test_a_commit_finds_its_incarnation_and_an_abort_only_a_region_being_created() -> None:
    check_committable("job/x", "u1")
    check_committable("job/x", "u1", "u1")          # again (ready already): idempotent
    with pytest.raises(RegionNotFound, match="removed while it was being created"):
        check_committable("job/x", None)
    with pytest.raises(RegionNotFound):
        check_committable("job/x", "u2", "u1")      # the name was deleted and created again
    assert abortable("creating", "u1") and abortable("creating", "u1", "u1")
    assert not abortable("ready", "u1") and not abortable(None, None)
    assert not abortable("creating", "u2", "u1")
