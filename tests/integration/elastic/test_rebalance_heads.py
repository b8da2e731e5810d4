"""A rebalance evens each region's primaries (heads), not only the bytes: the scenario
of an operator who evacuated a server and added a new one, against real processes,
while clients use both regions. Role swaps and graceful handovers copy nothing more
than the moves themselves; every check of the data is exact."""
from __future__ import annotations

import time
from collections import Counter

from smb_server.commands.local_cluster import LocalCluster
from tests.integration.daemons import wait_state
from tests.integration.elastic.test_evacuate import SETTLE, Load, MiB, holder_of_slot0, wait_empty

NAMES = ("job/a", "job/b")


def heads(c, name: str) -> list[str]:
    """The server heading each slot of region ``name`` (what its reads and mutations use)."""
    region = c.open_region(name)
    return [p.server_id for p in region.route.extents]


def rebalance(admin, loads: list[Load]) -> None:
    """Start a rebalance and wait until the controller says it is done."""
    admin.rebalance()
    deadline = time.monotonic() + SETTLE
    while admin.rebalance().running:
        for load in loads:
            assert not load.errors, load.errors
        assert time.monotonic() < deadline, "the rebalance does not end"
        time.sleep(0.1)


def test_a_rebalance_after_an_evacuation_and_a_join_evens_each_regions_heads(tmp_path):
    with LocalCluster(servers=4, capacity="256M", workdir=str(tmp_path / "cluster"), log_level="INFO") as pool, \
            pool.client(transport="tcp") as c, pool.admin_client() as admin:
        regions = [c.create_region(name, 8 * MiB, stripe_unit=MiB, replicas=2) for name in NAMES]
        assert all(len(r.route.extents) == 4 for r in regions)      # 4 slots each
        with Load(pool, "job/a", "tcp") as load_a, Load(pool, "job/b", "tcp") as load_b:
            loads = [load_a, load_b]
            for load in loads:
                load.wait_ops(100)
            source = holder_of_slot0(c, "job/a")
            admin.drain_server(source, evacuate=True)
            wait_empty(admin, source, load_a)
            pool.add_server()
            pool.wait_servers(4)                # the three left and the new one are up
            rebalance(admin, loads)
            for load in loads:
                load.wait_ops(100)              # and the load goes on at the new places
        for name in NAMES:
            wait_state(c, name, "ready", timeout=SETTLE)
        for region, load in zip(regions, loads, strict=True):
            load.check(region)                  # exact, through handles opened before the moves
        live = sorted(s.server_id for s in admin.list_servers() if s.state == "up")
        assert len(live) == 4 and source not in live
        total: Counter[str] = Counter()
        for name in NAMES:
            per = Counter(heads(c, name))
            total.update(per)
            counts = [per.get(sid, 0) for sid in live]
            assert max(counts) - min(counts) <= 1 and max(counts) <= 1, (name, per)   # ceil(4 / 4)
        counts = [total.get(sid, 0) for sid in live]
        assert max(counts) - min(counts) <= 1, total
        used = [s.used for s in admin.list_servers() if s.state == "up"]
        assert max(used) - min(used) <= 2 * MiB, used                              # within one copy
        assert not admin.rebalance().running                                        # nothing left
