"""The controller's state, with a fake clock: every test runs on both backends, SQLite
(a file in a temporary directory) and etcd (a real etcd server on loopback)."""
from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from smb_protocol import errors
from smb_protocol.names import check_region_name
from smb_server.controller.records import CreateRequest, HeldExtent
from smb_server.controller.stores import open_state
from smb_server.controller.stores.protocol import StateStore

MiB = 1 << 20
T0 = 1_000_000.0
LEASE = 5.0
GRACE = 30.0


@pytest.fixture(params=["sqlite", "etcd"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the state lives: a SQLite file, or an etcd URL with a prefix of its own."""
    if request.param == "etcd":
        return str(request.getfixturevalue("etcd_store"))
    return str(tmp_path / "controller.db")


@pytest.fixture
def state(db: str):
    s = open_state(db, lease_seconds=LEASE, orphan_grace_seconds=GRACE)
    try:
        yield s
    finally:
        s.close()


def add(state: StateStore, sid: str, capacity: int = 64 * MiB, now: float = T0) -> None:
    got, orphans = state.register_server(sid, f"host-{sid}", f"127.0.0.1:{1000 + ord(sid[-1])}",
                                         [f"tcp://127.0.0.1:{2000 + ord(sid[-1])}"], capacity, now=now)
    assert got == sid and orphans == []


def make(state: StateStore, name: str, size: int, now: float = T0, **kw):
    region = state.begin_create_region(CreateRequest(name, size, **kw), now=now)
    return state.commit_region(name, region.uid)


def test_register_and_list(state: StateStore) -> None:
    add(state, "a")
    add(state, "b", 32 * MiB)
    servers = state.list_servers()
    assert [s.server_id for s in servers] == ["a", "b"]
    assert servers[1].capacity == 32 * MiB and servers[1].used == 0 and servers[1].state == "up"
    assert servers[0].endpoints == ("tcp://127.0.0.1:2097",) and servers[0].host_id == "host-a"
    generated, _ = state.register_server("", "h", "127.0.0.1:9", [], MiB, now=T0)
    assert generated and generated not in ("a", "b")
    with pytest.raises(errors.InvalidArgument):
        state.register_server("x", "h", "", [], MiB)


def test_sqlite_always_leads_and_etcd_elects(state: StateStore, db: str) -> None:
    assert (state.leadership is None) == (not db.startswith("etcd://"))


def test_heartbeat_orphans_respect_grace(state: StateStore) -> None:
    add(state, "a")
    region = make(state, "job/w", 4 * MiB, placement="single")
    (known,) = region.extent_ids
    held = [HeldExtent(known, region.uid, 4 * MiB, 100.0),
            HeldExtent(11, "gone", MiB, GRACE - 1),     # young: maybe a create in flight
            HeldExtent(12, "gone", MiB, GRACE + 1)]     # old and unknown: an orphan
    assert state.heartbeat("a", held, now=T0 + 1) == [12]
    # a known id reported under another region uid is stale as well
    assert state.heartbeat("a", [HeldExtent(known, "other-uid", 4 * MiB, GRACE)], now=T0 + 2) == [known]
    # registration reconciles the same way
    _, orphans = state.register_server("a", "host-a", "127.0.0.1:1", [], 64 * MiB, held, now=T0 + 3)
    assert orphans == [12]
    with pytest.raises(errors.ServerNotFound):
        state.heartbeat("nobody", [], now=T0)


def test_deleted_region_extents_become_orphans(state: StateStore) -> None:
    add(state, "a")
    region = make(state, "job/w", MiB, placement="single")
    released = state.delete_region("job/w")
    assert [e.extent_id for e in released] == region.extent_ids
    assert released[0].grpc_address and released[0].server_state == "up"
    held = [HeldExtent(region.extent_ids[0], region.uid, MiB, GRACE)]
    assert state.heartbeat("a", held, now=T0 + 1) == region.extent_ids
    assert state.list_servers()[0].used == 0
    with pytest.raises(errors.RegionNotFound):
        state.delete_region("job/w")


def test_lease_expiry_marks_down_and_degrades_regions(state: StateStore) -> None:
    add(state, "a")
    add(state, "b")
    make(state, "job/p", 4 * MiB, stripe_unit=MiB)
    assert state.expire_leases(now=T0 + LEASE - 0.1) == []
    state.heartbeat("a", [], now=T0 + LEASE)
    assert state.expire_leases(now=T0 + LEASE + 0.5) == ["b"]
    assert {s.server_id: s.state for s in state.list_servers()} == {"a": "up", "b": "down"}
    region = state.get_region("job/p")
    assert region.state == "degraded"
    assert {e.server_id: e.server_state for e in region.extents} == {"a": "up", "b": "down"}
    assert [r.state for r in state.list_regions()] == ["degraded"]
    # new regions avoid the down server
    other = make(state, "job/q", 2 * MiB, now=T0 + LEASE + 0.5)
    assert {e.server_id for e in other.extents} == {"a"}
    # a heartbeat brings it back
    state.heartbeat("b", [], now=T0 + LEASE + 1)
    assert state.get_region("job/p").state == "ready"


def test_silent_server_gets_no_extents_even_before_expiry_runs(state: StateStore) -> None:
    add(state, "a")
    with pytest.raises(errors.OutOfMemory):
        state.begin_create_region(CreateRequest("job/x", MiB), now=T0 + LEASE + 1)


def test_drain_excludes_server_from_placement(state: StateStore) -> None:
    add(state, "a")
    add(state, "b")
    assert state.drain("a").state == "draining"
    region = make(state, "job/p", 4 * MiB, stripe_unit=MiB)
    assert {e.server_id for e in region.extents} == {"b"}
    # drain survives a down/up cycle and re-registration
    state.expire_leases(now=T0 + LEASE + 1)
    assert state.get_server("a").state == "down"
    state.heartbeat("a", [], now=T0 + LEASE + 2)
    assert state.get_server("a").state == "draining"
    state.register_server("a", "host-a", "127.0.0.1:1", [], 64 * MiB, now=T0 + LEASE + 2)
    assert state.get_server("a").state == "draining"
    assert state.drain("a", undrain=True).state == "up"
    # an unknown id says where an operator finds the ids, not which RPC lists them
    with pytest.raises(errors.ServerNotFound, match="`smb status` lists the ids"):
        state.drain("nobody")
    with pytest.raises(errors.ServerNotFound, match="`smb status` lists the ids"):
        state.remove_server("nobody")


def test_an_evacuation_survives_a_restart_and_a_removed_server_cannot_rejoin(state: StateStore) -> None:
    add(state, "a")
    add(state, "b")
    assert state.drain("a", evacuate=True).evacuating
    state.expire_leases(now=T0 + LEASE + 1)
    state.register_server("a", "host-a", "127.0.0.1:1", [], 64 * MiB, now=T0 + LEASE + 2)
    again = state.get_server("a")
    assert (again.state, again.evacuating) == ("draining", True)   # still moving its copies away
    state.heartbeat("a", [], now=T0 + LEASE + 3)
    state.heartbeat("b", [], now=T0 + LEASE + 3)
    assert state.get_server("a").evacuating
    with pytest.raises(errors.InvalidArgument, match="drain it first"):
        state.remove_server("b")
    assert state.remove_server("a").server_id == "a"
    assert [s.server_id for s in state.list_servers()] == ["b"]
    with pytest.raises(errors.ServerNotFound):
        state.heartbeat("a", [], now=T0 + LEASE + 4)
    # its daemon, still running, registers again: refused, so it cannot take extents unseen
    with pytest.raises(errors.ServerNotFound, match="removed from the pool"):
        state.register_server("a", "host-a", "127.0.0.1:1", [], 64 * MiB, now=T0 + LEASE + 5)
    assert [s.server_id for s in state.list_servers()] == ["b"]


def test_over_capacity_is_out_of_memory(state: StateStore) -> None:
    add(state, "a", 8 * MiB)
    add(state, "b", 8 * MiB)
    make(state, "job/big", 12 * MiB, stripe_unit=MiB)  # 6 MiB on each
    used = {s.server_id: s.used for s in state.list_servers()}
    assert used == {"a": 6 * MiB, "b": 6 * MiB}
    with pytest.raises(errors.OutOfMemory, match="free"):
        state.begin_create_region(CreateRequest("job/more", 6 * MiB, stripe_unit=MiB), now=T0)
    with pytest.raises(errors.OutOfMemory):
        state.begin_create_region(CreateRequest("job/one", 3 * MiB, placement="single"), now=T0)
    # nothing was recorded by the failed attempts
    assert [r.name for r in state.list_regions()] == ["job/big"]
    make(state, "job/fits", 4 * MiB, stripe_unit=MiB)


def test_layered_region_layout(state: StateStore) -> None:
    add(state, "a")
    add(state, "b")
    region = make(state, "job/layers", 7 * MiB, placement="layered",
                  segment_sizes=(4 * MiB, 2 * MiB, MiB))
    assert region.segment_sizes == (4 * MiB, 2 * MiB, MiB)
    layout = region.layout()
    assert sorted(layout.extent_lengths) == [3 * MiB, 4 * MiB]
    assert len(layout.map(0, 4 * MiB)) == 1
    with pytest.raises(errors.InvalidArgument):
        state.begin_create_region(CreateRequest("job/bad", 7 * MiB, placement="striped", segment_sizes=(7 * MiB,)))


@pytest.mark.parametrize("name", ["job/params", "a/b", "a.b/c_d-e/F9", "x/" + "x" * 253, "j/..x"])
def test_good_names(name: str) -> None:
    assert check_region_name(name) == name


@pytest.mark.parametrize("name", ["", "/a", "a/", "a//b", "a b", "a/b?", "x/" + "x" * 254, "é/x",
                                  "a", "..", ".", "../x", "x/..", "a/./b", "x" * (1 << 20)])
def test_bad_names(state: StateStore, name: str) -> None:
    add(state, "a")
    with pytest.raises(errors.InvalidArgument):
        state.begin_create_region(CreateRequest(name, MiB), now=T0)


def test_region_exists_and_not_found(state: StateStore) -> None:
    add(state, "a")
    make(state, "job/p", MiB)
    with pytest.raises(errors.RegionExists):
        state.begin_create_region(CreateRequest("job/p", MiB), now=T0)
    with pytest.raises(errors.RegionNotFound):
        state.get_region("job/q")
    state.begin_create_region(CreateRequest("job/c", MiB), now=T0)
    with pytest.raises(errors.RegionExists, match="being created"):
        state.begin_create_region(CreateRequest("job/c", MiB), now=T0)
    with pytest.raises(errors.RegionNotFound):  # not visible until committed
        state.get_region("job/c")
    assert [r.name for r in state.list_regions()] == ["job/p"]
    assert len(state.abort_region("job/c")) == 1
    assert state.abort_region("job/c") == []
    assert state.list_servers()[0].used == MiB


def test_list_regions_by_prefix(state: StateStore) -> None:
    add(state, "a")
    for name in ("job1/a", "job1/b", "job2/a", "other/x"):
        make(state, name, MiB)
    assert [r.name for r in state.list_regions("job1/")] == ["job1/a", "job1/b"]
    assert len(state.list_regions()) == 4
    assert state.list_regions("nothing") == []


def test_extent_ids_unique_63_bit(state: StateStore) -> None:
    add(state, "a", 1 << 40)
    ids = []
    for i in range(20):
        ids += make(state, f"job/r{i}", 8 * MiB, stripe_unit=MiB).extent_ids
    assert len(set(ids)) == len(ids)
    assert all(0 < i < (1 << 63) for i in ids)


def test_reopen_keeps_regions_and_extents(db: str) -> None:
    with closing(open_state(db, LEASE, GRACE)) as s:
        add(s, "a")
        add(s, "b")
        before = make(s, "job/p", 4 * MiB, stripe_unit=MiB)
        s.drain("b")
        before = s.get_region("job/p")
    with closing(open_state(db, LEASE, GRACE)) as s:
        after = s.get_region("job/p")
        assert after == before
        assert {x.server_id: x.used for x in s.list_servers()} == {"a": 2 * MiB, "b": 2 * MiB}
        assert s.get_server("b").state == "draining"
    if not db.startswith("etcd://"):
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.close()


def test_creating_rows_cleaned_on_reopen(db: str) -> None:
    with closing(open_state(db, LEASE, GRACE)) as s:
        add(s, "a")
        make(s, "job/kept", MiB)
        half = s.begin_create_region(CreateRequest("job/half", 2 * MiB), now=T0)  # the controller "dies" here
    with closing(open_state(db, LEASE, GRACE)) as s:
        assert [r.name for r in s.list_regions()] == ["job/kept"]
        assert s.list_servers()[0].used == MiB
        # the server reserved the half-created extent: it is an orphan after the grace
        held = [HeldExtent(half.extent_ids[0], half.uid, 2 * MiB, GRACE)]
        assert s.heartbeat("a", held, now=T0 + 1) == half.extent_ids
        s.begin_create_region(CreateRequest("job/half", 2 * MiB), now=T0)  # the name is free again


@pytest.mark.parametrize("field, value", [("size", 1 << 63), ("stripe_unit", 1 << 63),
                                          ("stripe_unit", 1 << 64), ("segment_sizes", [1 << 63])])
def test_sizes_beyond_int64_are_invalid(state: StateStore, field: str, value: object) -> None:
    add(state, "a")
    kwargs: dict = {"size": MiB, field: value}
    if field == "segment_sizes":
        kwargs["placement"] = "layered"
    with pytest.raises(errors.InvalidArgument, match="2\\^63-1"):
        state.begin_create_region(CreateRequest("job/huge", **kwargs), now=T0)


def test_capacity_beyond_int64_is_invalid(state: StateStore) -> None:
    with pytest.raises(errors.InvalidArgument, match="capacity"):
        state.register_server("big", "h", "127.0.0.1:1", [], 1 << 63, now=T0)


def test_server_back_without_an_extent_makes_its_region_lost(state: StateStore, db: str) -> None:
    add(state, "a")
    add(state, "b")
    region = make(state, "job/x", 8 * MiB, stripe_unit=MiB)
    on_a = [e for e in region.extents if e.server_id == "a"]
    on_b = [e for e in region.extents if e.server_id == "b"]
    assert on_a and on_b
    # b goes down: degraded, it may come back with its memory
    state.heartbeat("a", [HeldExtent(e.extent_id, region.uid, e.length, 1.0) for e in on_a],
                    now=T0 + 1.5 * LEASE)
    state.expire_leases(now=T0 + 2 * LEASE)
    assert state.get_region("job/x").state == "degraded"
    # b comes back holding its extents: ready again
    state.register_server("b", "host-b", "127.0.0.1:1098", [], 64 * MiB,
                          held=[HeldExtent(e.extent_id, region.uid, e.length, 1.0) for e in on_b],
                          now=T0 + 3 * LEASE)
    assert state.get_region("job/x").state == "ready"
    # a comes back without its memory: lost, naming a, also after a restart of the controller
    state.register_server("a", "host-a", "127.0.0.1:1097", [], 64 * MiB, held=[], now=T0 + 3 * LEASE)
    lost = state.get_region("job/x")
    assert lost.state == "lost" and lost.lost_servers == ["a"]
    assert [r.state for r in state.list_regions()] == ["lost"]
    state.close()
    with closing(open_state(db, LEASE, GRACE)) as again:
        assert again.get_region("job/x").state == "lost"
        assert {e.extent_id for e in again.delete_region("job/x")} == set(region.extent_ids)
        with pytest.raises(errors.RegionNotFound):
            again.get_region("job/x")
        make(again, "job/y", 2 * MiB)
        assert again.get_region("job/y").state == "ready"


def test_many_servers_expire_and_a_region_spans_many(state: StateStore) -> None:
    # more servers than etcd takes operations in one transaction (128 by default)
    for k in range(280):
        state.register_server(f"s{k:03d}", f"h{k}", f"127.0.0.1:{3000 + k}", [], 64 * MiB, now=T0)
    wide = make(state, "job/wide", 100 * MiB, stripe_unit=MiB, num_servers=100)
    assert len({e.server_id for e in wide.extents}) == 100
    assert len(set(wide.extent_ids)) == 100
    for k in range(0, 280, 2):
        state.heartbeat(f"s{k:03d}", [], now=T0 + LEASE)
    expired = state.expire_leases(now=T0 + LEASE + 1)
    assert expired == [f"s{k:03d}" for k in range(1, 280, 2)]
    assert state.get_region("job/wide").state == "degraded"
    assert sum(s.state == "down" for s in state.list_servers()) == 140


def test_a_region_may_take_the_callers_uid(state: StateStore) -> None:
    add(state, "a")
    uid = "0123456789abcdef" * 2
    region = make(state, "job/mine", MiB, uid=uid)
    assert region.uid == uid and state.get_region("job/mine").uid == uid
    with pytest.raises(errors.InvalidArgument, match="already names another region"):
        state.begin_create_region(CreateRequest("job/other", MiB, uid=uid), now=T0)
    for bad in ("xyz", uid.upper(), uid + "0"):
        with pytest.raises(errors.InvalidArgument, match="32 lowercase hex"):
            state.begin_create_region(CreateRequest("job/bad", MiB, uid=bad), now=T0)
    assert [r.name for r in state.list_regions()] == ["job/mine"]


def test_a_done_delete_is_remembered_for_its_retries(state: StateStore) -> None:
    add(state, "a")
    for name in ("job/a", "job/b", "job/c"):
        make(state, name, MiB)
    first, other = "1" * 32, "2" * 32
    region = state.get_region("job/a")
    state.delete_region("job/a", first, now=T0)
    done = state.deleted_by("job/a", first)
    assert done is not None and done.uid == region.uid      # and where its extents were
    assert done.extents == tuple((e.server_id, e.extent_id, e.grpc_address) for e in region.extents)
    assert state.deleted_by("job/a", other) is None and state.deleted_by("job/b", first) is None
    assert state.deleted_by("job/a", "") is None
    state.delete_region("job/b", now=T0 + 10)                 # no request id: nothing kept
    assert state.deleted_by("job/b", "") is None
    # an hour later the next delete forgets the old ones
    state.delete_region("job/c", other, now=T0 + 3601)
    assert state.deleted_by("job/a", first) is None and state.deleted_by("job/c", other) is not None
    with pytest.raises(errors.InvalidArgument, match="32 lowercase hex"):
        state.delete_region("job/x", "nope")


OWNER = "ab" * 16


def test_owner_leases_name_the_regions_of_an_owner_that_stopped_renewing(state: StateStore) -> None:
    add(state, "a")
    for name in ("job/x", "job/y", "keep/other"):
        make(state, name, MiB)
    state.lease_region("job/x", OWNER, 10.0, now=T0)
    state.lease_region("job/y", OWNER, 4.0, now=T0)        # the owner's lease is its longest
    assert state.expired_leases(now=T0 + 9) == []
    assert state.renew_lease(OWNER, now=T0 + 9) == 2        # until T0 + 19
    assert state.expired_leases(now=T0 + 18) == []
    assert state.expired_leases(now=T0 + 19.5) == ["job/x", "job/y"]
    assert state.renew_lease(OWNER, now=T0 + 20) == 0       # too late: renewing revives nothing
    assert state.expired_leases(now=T0 + 20) == ["job/x", "job/y"]
    state.delete_region("job/x")
    state.delete_region("job/y")
    assert state.expired_leases(now=T0 + 21) == []          # the owner is forgotten with them
    assert state.renew_lease(OWNER, now=T0 + 21) == 0
    assert [r.name for r in state.list_regions()] == ["keep/other"]
    assert state.renew_lease("cd" * 16, now=T0) == 0         # an owner nobody knows
    with pytest.raises(errors.InvalidArgument, match="owner"):
        state.lease_region("keep/other", "not-hex", 5.0, now=T0)
    with pytest.raises(errors.InvalidArgument, match="lease"):
        state.lease_region("keep/other", OWNER, 0.0, now=T0)
    assert state.expired_leases(now=T0 + 1e6) == []         # keep/other was never leased


# -- replicated regions -------------------------------------------------------------------
def add_on_host(state: StateStore, sid: str, host: str, capacity: int = 64 * MiB, now: float = T0) -> None:
    state.register_server(sid, host, f"127.0.0.1:{1000 + ord(sid[-1])}",
                          [f"tcp://127.0.0.1:{2000 + ord(sid[-1])}"], capacity, now=now)


def test_a_replicated_region_puts_every_slot_on_distinct_servers(state: StateStore) -> None:
    for sid in "abcd":
        add(state, sid)
    region = make(state, "job/r", 8 * MiB, stripe_unit=MiB, replicas=2)
    assert region.replicas == 2 and region.state == "ready" and region.slots == 4
    assert len(region.extents) == 8 and len(set(region.extent_ids)) == 8
    for idx in range(4):
        copies = region.copies_of(idx)
        assert [c.copy for c in copies] == [0, 1]
        assert [c.role for c in copies] == ["primary", "backup"]
        assert {c.view for c in copies} == {1}
        assert len({c.server_id for c in copies}) == 2
    primaries = region.primaries()
    assert [p.index for p in primaries] == [0, 1, 2, 3]
    assert len({p.server_id for p in primaries}) == 4          # balanced: one primary each
    assert region.layout().extent_lengths == (2 * MiB,) * 4
    assert {e.extent_id for e in region.others()} == set(region.extent_ids) - {p.extent_id for p in primaries}
    assert {s.server_id: s.used for s in state.list_servers()} == dict.fromkeys("abcd", 4 * MiB)
    assert state.get_region("job/r") == region
    plain = make(state, "job/plain", 2 * MiB)
    assert plain.replicas == 1 and {e.role for e in plain.extents} == {""}
    assert {e.view for e in plain.extents} == {0}


def test_replicas_are_checked(state: StateStore) -> None:
    add(state, "a")
    add(state, "b")
    for bad in (4, -1):
        with pytest.raises(errors.InvalidArgument, match="replicas"):
            state.begin_create_region(CreateRequest("job/r", MiB, replicas=bad), now=T0)
    with pytest.raises(errors.OutOfMemory, match="3 copies of every byte need 3 memory servers, only 2"):
        state.begin_create_region(CreateRequest("job/r", MiB, replicas=3), now=T0)
    assert make(state, "job/r", MiB, replicas=0).replicas == 1


def test_copies_prefer_other_hosts(state: StateStore) -> None:
    add_on_host(state, "a", "h1", 64 * MiB)
    add_on_host(state, "b", "h1", 63 * MiB)
    add_on_host(state, "c", "h2", 10 * MiB)
    region = make(state, "job/r", 2 * MiB, placement="single", replicas=2)
    assert [c.host_id for c in region.copies_of(0)] == ["h1", "h2"]


def test_replicated_region_states(state: StateStore) -> None:
    for sid in "abc":
        add(state, sid)
    region = make(state, "job/r", 3 * MiB, stripe_unit=MiB, replicas=2)
    slot0 = region.copies_of(0)
    backup = slot0[1]
    # the backup's server goes down: degraded, not lost
    for sid in "abc":
        if sid != backup.server_id:
            state.heartbeat(sid, [], now=T0 + LEASE)
    state.expire_leases(now=T0 + LEASE + 1)
    assert state.get_region("job/r").state == "degraded"
    # it comes back without its memory: the slot still has its primary, degraded
    held = [HeldExtent(e.extent_id, region.uid, e.length, 1.0) for e in region.extents
            if e.server_id == backup.server_id and e.extent_id != backup.extent_id]
    state.register_server(backup.server_id, f"host-{backup.server_id}", "127.0.0.1:9", [], 64 * MiB,
                          held=held, now=T0 + LEASE + 2)
    again = state.get_region("job/r")
    assert again.state == "degraded" and again.lost_servers == [backup.server_id]
    # the primary's server loses it as well: no copy of slot 0 is left
    primary = slot0[0]
    held = [HeldExtent(e.extent_id, region.uid, e.length, 1.0) for e in region.extents
            if e.server_id == primary.server_id and e.extent_id != primary.extent_id]
    state.register_server(primary.server_id, f"host-{primary.server_id}", "127.0.0.1:8", [], 64 * MiB,
                          held=held, now=T0 + LEASE + 3)
    assert state.get_region("job/r").state == "lost"


def test_slot_changes_are_atomic_and_views_grow(state: StateStore, db: str) -> None:
    from smb_server.controller.records import NewCopy, SlotChange
    for sid in "abc":
        add(state, sid)
    region = make(state, "job/r", MiB, placement="single", replicas=2)
    p, b = region.copies_of(0)
    spare = ({"a", "b", "c"} - {p.server_id, b.server_id}).pop()
    # promote the backup, the old primary goes stale
    after, removed = state.change_slot("job/r", region.uid, SlotChange(0, 1, {0: "stale", 1: "primary"}))
    assert removed == [] and after.view_of(0) == 2
    assert [(c.copy, c.role, c.view) for c in after.copies_of(0)] == [(0, "stale", 2), (1, "primary", 2)]
    assert after.primaries()[0].extent_id == b.extent_id and after.others() == []
    assert after.state == "degraded"
    # a change decided on an older view is refused; nothing changes
    assert state.change_slot("job/r", region.uid, SlotChange(0, 1, {0: "backup"})) is None
    with pytest.raises(errors.RegionNotFound):
        state.change_slot("job/r", "f" * 32, SlotChange(0, 2))
    with pytest.raises(errors.InvalidArgument, match="two primaries"):
        state.change_slot("job/r", region.uid, SlotChange(0, 2, {0: "primary"}))
    with pytest.raises(errors.InvalidArgument, match="holds a copy"):
        state.change_slot("job/r", region.uid, SlotChange(0, 2, add=NewCopy(2, p.server_id)))
    with pytest.raises(errors.InvalidArgument, match="no copy"):
        state.change_slot("job/r", region.uid, SlotChange(0, 2, {5: "backup"}))
    # a syncing copy on the spare, with a fresh extent id
    after, _ = state.change_slot("job/r", region.uid, SlotChange(0, 2, add=NewCopy(2, spare)))
    new = after.copies_of(0)[2]
    assert (new.role, new.view, new.server_id, new.length) == ("syncing", 3, spare, MiB)
    assert new.extent_id not in region.extent_ids and new.extent_id > 0
    assert [e.extent_id for e in after.others()] == [new.extent_id]
    assert state.get_server(spare).used == MiB
    # its server reports it: not an orphan
    assert state.heartbeat(spare, [HeldExtent(new.extent_id, region.uid, MiB, GRACE + 1)], now=T0 + 1) == []
    # in step: a backup; the stale copy goes
    after, removed = state.change_slot("job/r", region.uid,
                                       SlotChange(0, 3, {2: "backup"}, frozenset({0})))
    assert [e.extent_id for e in removed] == [p.extent_id]
    assert [(c.copy, c.role, c.view) for c in after.copies_of(0)] == [(1, "primary", 4), (2, "backup", 4)]
    assert after.state == "ready"
    # the dropped copy is an orphan on its server now
    assert state.heartbeat(p.server_id, [HeldExtent(p.extent_id, region.uid, MiB, GRACE + 1)],
                           now=T0 + 1) == [p.extent_id]
    state.close()
    with closing(open_state(db, LEASE, GRACE)) as again:
        assert again.get_region("job/r") == after
        assert {e.extent_id for e in again.delete_region("job/r")} == {b.extent_id, new.extent_id}


def test_change_slot_forgets_a_removed_lost_copy(state: StateStore) -> None:
    from smb_server.controller.records import SlotChange
    add(state, "a")
    add(state, "b")
    region = make(state, "job/r", MiB, placement="single", replicas=2)
    p, b = region.copies_of(0)
    state.register_server(b.server_id, f"host-{b.server_id}", "127.0.0.1:7", [], 64 * MiB, now=T0 + 1)
    assert state.get_region("job/r").copies_of(0)[1].lost
    after, removed = state.change_slot("job/r", region.uid, SlotChange(0, 1, {1: "stale"}, frozenset({1})))
    assert [e.extent_id for e in removed] == [b.extent_id] and removed[0].lost
    assert after.lost_servers == [] and after.state == "degraded"   # one copy of two


def test_an_older_sqlite_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE servers (server_id TEXT PRIMARY KEY, host_id TEXT NOT NULL DEFAULT '',
            grpc_address TEXT NOT NULL, endpoints TEXT NOT NULL DEFAULT '[]', capacity INTEGER NOT NULL,
            state TEXT NOT NULL, drain INTEGER NOT NULL DEFAULT 0, last_heartbeat REAL NOT NULL,
            registered_at REAL NOT NULL);
        CREATE TABLE regions (name TEXT PRIMARY KEY, uid TEXT NOT NULL UNIQUE, size INTEGER NOT NULL,
            placement TEXT NOT NULL, stripe_unit INTEGER NOT NULL DEFAULT 0,
            segment_sizes TEXT NOT NULL DEFAULT '[]', segment_extents TEXT NOT NULL DEFAULT '[]',
            persistent INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('creating', 'ready')));
        CREATE TABLE extents (extent_id INTEGER PRIMARY KEY,
            region_name TEXT NOT NULL REFERENCES regions(name) ON DELETE CASCADE,
            idx INTEGER NOT NULL, server_id TEXT NOT NULL REFERENCES servers(server_id),
            length INTEGER NOT NULL, UNIQUE (region_name, idx));
        CREATE INDEX extents_by_server ON extents(server_id);
        INSERT INTO servers VALUES ('a', 'h', '127.0.0.1:1', '[]', 67108864, 'up', 0, 1000000.0, 1000000.0);
        INSERT INTO regions VALUES ('job/old', 'aa', 1048576, 'single', 0, '[]', '[]', 0, 1.0, 'ready');
        INSERT INTO extents VALUES (42, 'job/old', 0, 'a', 1048576);
        PRAGMA user_version=1;
    """)
    conn.close()
    with closing(open_state(str(path), LEASE, GRACE)) as s:
        old = s.get_region("job/old")
        assert old.replicas == 1 and old.extent_ids == [42] and old.state == "ready"
        assert (old.extents[0].copy, old.extents[0].role, old.extents[0].view) == (0, "", 0)
        add(s, "b")
        s.heartbeat("a", [], now=T0)
        region = make(s, "job/new", MiB, placement="single", replicas=2)
        assert len(region.extents) == 2
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    conn.close()


def test_etcd_rows_written_before_replication_read_as_unreplicated() -> None:
    from smb_server.controller.stores.etcd.txn import _extent_row
    assert _extent_row([7, 0, "a", 4096]) == (7, 0, "a", 4096, 0, "", 0)
    assert _extent_row([7, 2, "b", 10, 1, "backup", 5]) == (7, 2, "b", 10, 1, "backup", 5)
