"""The parameter store's plan (smb_client.torch.store_plan.plan_store): sizes, names and
options of every region, worked out with no client."""
from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import FlatModel  # noqa: E402
from smb_client.torch.store_plan import (  # noqa: E402
    BUFFER_SLOTS,
    COUNTER_WORDS,
    META_HEADER,
    META_MAGIC,
    SYNC_SLOTS,
    StorePlan,
    plan_store,
)
from smb_protocol.errors import InvalidArgument  # noqa: E402


def model(mixed: bool = False, norm: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(3, 4)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(4))
    layers.append(torch.nn.Linear(4, 2))
    m = torch.nn.Sequential(*layers)
    if mixed:
        m[-1].to(torch.bfloat16)
    return m


def plan(m: torch.nn.Module, **options: Any) -> StorePlan:
    given: dict[str, Any] = dict(scheme=None, placement="striped", grad_slots=None, delta_slots=None, workers=1,
                                 buffers=True, stripe_unit=None, num_servers=0, lease=None, replicas=1, attempt=0)
    return plan_store("job", FlatModel(m), **{**given, **options})


def test_the_default_sync_scheme_reserves_slots_only_for_mixed_types():
    one, mixed = plan(model()), plan(model(mixed=True))
    assert (one.grad_slots, one.delta_slots) == (0, 0)
    assert (mixed.grad_slots, mixed.delta_slots) == (SYNC_SLOTS, 0)
    assert [r.kind for r in one.regions] == ["params", "counters", "buffers"]
    assert [r.kind for r in mixed.regions] == ["params", "grads", "counters", "buffers"]


def test_seasgd_sizes_one_delta_slot_per_worker_and_a_given_count_wins():
    p = plan(model(), scheme="seasgd", workers=3)
    assert (p.grad_slots, p.delta_slots) == (0, 3)
    assert (plan(model(), grad_slots=3).grad_slots, plan(model(), grad_slots=3).delta_slots) == (3, 0)


def test_sizes_names_and_options():
    m = model()
    p = plan(m, workers=2, replicas=2, lease=5, stripe_unit=4096, num_servers=2, grad_slots=3)
    slot = FlatModel(model()).layout.slot_bytes
    regions = {r.kind: r for r in p.regions}
    assert regions["params"].size == slot and regions["grads"].size == 3 * slot
    assert regions["params"].name == "job/params"
    assert regions["grads"].options == {"placement": "striped", "stripe_unit": 4096, "num_servers": 2,
                                        "replicas": 2}
    assert regions["counters"].size >= (COUNTER_WORDS + 2 * 2) * 8
    assert regions["counters"].options == {"placement": "single", "replicas": 2}
    assert regions["buffers"].size == p.buffer_layout.slot_bytes * BUFFER_SLOTS  # type: ignore[union-attr]
    assert not p.needs_servers


def test_layered_and_single_placements():
    layered = {r.kind: r for r in plan(model(), placement="layered", grad_slots=2).regions}
    assert layered["grads"].options["segment_sizes"] == FlatModel(model()).layout.segment_sizes(2)
    assert all(r.options == {"placement": "single"} for r in plan(model(), placement="single").regions)


def test_a_striped_plan_without_a_stripe_unit_is_spread_over_the_servers_up():
    p = plan(model())
    assert p.needs_servers and p.regions[0].options["stripe_unit"] == 0
    spread = p.spread_over(3)
    assert spread.stripe_unit == p.layout.stripe_unit(3) and not spread.needs_servers
    assert plan(model(), num_servers=2).spread_over(5).stripe_unit == p.layout.stripe_unit(2)


def test_the_description_round_trips():
    p = plan(model(), lease=7, attempt=2)
    blob = p.description()
    magic, length = META_HEADER.unpack(blob[:META_HEADER.size])
    meta = json.loads(blob[META_HEADER.size:])
    assert (magic, length) == (META_MAGIC, len(blob) - META_HEADER.size)
    assert list(meta) == ["layout", "placement", "grad_slots", "delta_slots", "workers", "buffers", "lease",
                          "attempt"]
    assert (meta["lease"], meta["attempt"]) == (7.0, 2)
    assert p.description_region(len(blob)).size % 4096 == 0
    assert "lease" not in plan(model()).meta and plan(model(), buffers=False).meta["buffers"] is None
    assert plan(model(norm=False)).buffer_layout is None


@pytest.mark.parametrize("options", [dict(placement="nowhere"), dict(scheme="async"), dict(workers=0),
                                     dict(grad_slots=-1)])
def test_options_that_cannot_apply(options):
    with pytest.raises(InvalidArgument):
        plan(model(), **options)
