"""The controller's rules (smb_server.controller.rules), with no store: records in,
changes out."""
from __future__ import annotations

from smb_server.controller.records import DELETE_MEMORY_SECONDS, DeletedRegion, HeldExtent
from smb_server.controller.rules import (
    delete_memory_horizon,
    drained_state,
    half_created,
    lease_ran_out,
    live_state,
    lost_on_register,
    refreshed_on_take_over,
    retried_delete,
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
