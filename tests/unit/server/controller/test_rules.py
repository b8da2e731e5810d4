"""The controller's rules (smb_server.controller.rules), with no store: records in,
changes out."""
from __future__ import annotations

from smb_server.controller.records import HeldExtent
from smb_server.controller.rules import (
    drained_state,
    lease_ran_out,
    live_state,
    lost_on_register,
    refreshed_on_take_over,
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
