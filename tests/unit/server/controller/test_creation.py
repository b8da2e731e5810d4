"""The create/delete sequence against an in-memory MemoryServers and a real (in-memory
SQLite) ControllerState."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from smb_protocol import errors
from smb_server.controller.barriers import Barriers
from smb_server.controller.creation import RegionCreator
from smb_server.controller.memservers import Backup, MemoryServers
from smb_server.controller.records import CreateRequest, ExtentRecord
from smb_server.controller.stores.sqlite.state import ControllerState

MiB = 1 << 20


class InMemoryServers:
    """A MemoryServers that keeps reservations in a dict per address.

    ``fail[address]`` makes reserve on that address raise it (``fail_once``: the next
    time only); ``gate`` (when set) makes
    every reserve wait until it is set; ``release_fails`` makes release raise.
    """

    def __init__(self) -> None:
        self.held: dict[str, dict[int, tuple[str, int]]] = {}
        self.fail: dict[str, errors.SMBError] = {}
        self.fail_once: dict[str, errors.SMBError] = {}
        self.release_fails: errors.SMBError | None = None
        self.released: list[int] = []
        self.configured: list[tuple[str, int, int, str, list[tuple[int, bool]]]] = []
        self.configure_fails: dict[str, errors.SMBError] = {}
        self.synced_bytes = 0
        self.gate: threading.Event | None = None
        self.reserving = threading.Event()
        self.lock = threading.Lock()

    def reserve(self, address: str, region_uid: str, extent: ExtentRecord,
                persistent: bool = False) -> None:
        self.reserving.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if address in self.fail:
            raise self.fail[address]
        with self.lock:
            once = self.fail_once.pop(address, None)
        if once is not None:
            raise once
        with self.lock:
            self.held.setdefault(address, {})[extent.extent_id] = (region_uid, extent.length)

    def release(self, address: str, region_uid: str, extent: ExtentRecord) -> bool:
        if self.release_fails is not None:
            raise self.release_fails
        with self.lock:
            self.released.append(extent.extent_id)
            return self.held.get(address, {}).pop(extent.extent_id, None) is not None

    def configure_replicas(self, address: str, region_uid: str, extent: ExtentRecord, view: int,
                           role: str, backups: Sequence[Backup] = ()) -> tuple[int, int]:
        if address in self.configure_fails:
            raise self.configure_fails[address]
        synced = sum(b.extent.length for b in backups if b.sync)
        with self.lock:
            assert extent.extent_id in self.held.get(address, {}), "configured before reserved"
            self.configured.append((address, extent.extent_id, view, role,
                                    [(b.extent.extent_id, b.sync) for b in backups]))
            self.synced_bytes += synced
        return view, synced

    def total(self) -> int:
        with self.lock:
            return sum(len(h) for h in self.held.values())


@pytest.fixture
def state() -> Iterator[ControllerState]:
    s = ControllerState(":memory:", lease_seconds=1e9)
    for i in range(3):
        s.register_server(f"s{i}", f"h{i}", f"mem{i}:1", [], 64 * MiB)
    yield s
    s.close()


@pytest.fixture
def servers() -> InMemoryServers:
    return InMemoryServers()


@pytest.fixture
def creator(state: ControllerState, servers: InMemoryServers) -> Iterator[RegionCreator]:
    c = RegionCreator(state, servers, threads=4, exist_ok_wait=5.0)
    yield c
    c.close()


def test_in_memory_servers_is_a_memory_servers() -> None:
    impl: MemoryServers = InMemoryServers()  # checked by mypy
    assert impl is not None


def test_create_reserves_every_extent_then_commits(creator: RegionCreator,
                                                   servers: InMemoryServers,
                                                   state: ControllerState) -> None:
    region = creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB))
    assert region.state == "ready"
    assert len(region.extents) == 3
    for e in region.extents:
        assert servers.held[e.grpc_address][e.extent_id] == (region.uid, e.length)
    assert state.get_region("job/p").uid == region.uid


def test_failure_in_the_middle_releases_what_was_reserved(creator: RegionCreator,
                                                          servers: InMemoryServers,
                                                          state: ControllerState) -> None:
    servers.fail["mem1:1"] = errors.ServerUnavailable("connection refused")
    with pytest.raises(errors.ServerUnavailable, match=r"server s1 at mem1:1.*nothing was created"):
        creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB))
    assert servers.total() == 0
    assert len(servers.released) == 2          # the two that did reserve
    with pytest.raises(errors.RegionNotFound):
        state.get_region("job/p")
    del servers.fail["mem1:1"]                 # the name is free again
    assert creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB)).state == "ready"


def test_out_of_memory_is_reported_before_other_failures(creator: RegionCreator,
                                                         servers: InMemoryServers) -> None:
    servers.fail["mem0:1"] = errors.ServerUnavailable("down")
    servers.fail["mem2:1"] = errors.OutOfMemory("no room")
    with pytest.raises(errors.OutOfMemory, match=r"s2.*\(and 1 more\)"):
        creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB))
    assert servers.total() == 0


def test_a_bug_in_reserve_still_rolls_back(creator: RegionCreator, servers: InMemoryServers,
                                           state: ControllerState) -> None:
    servers.fail["mem0:1"] = RuntimeError("boom")  # type: ignore[assignment]
    with pytest.raises(errors.ServerError, match="boom"):
        creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB))
    assert servers.total() == 0
    assert state.list_regions() == []


def test_region_deleted_before_commit_releases(creator: RegionCreator, servers: InMemoryServers,
                                               state: ControllerState) -> None:
    servers.gate = threading.Event()
    result: list[BaseException] = []

    def create() -> None:
        try:
            creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append(exc)

    t = threading.Thread(target=create)
    t.start()
    assert servers.reserving.wait(5)
    state.abort_region("job/p")                # removed while being created
    servers.gate.set()
    t.join(10)
    assert isinstance(result[0], errors.RegionNotFound)
    assert servers.total() == 0


def test_exist_ok_waits_for_a_concurrent_create(creator: RegionCreator,
                                                servers: InMemoryServers) -> None:
    servers.gate = threading.Event()
    first: list[object] = []
    t = threading.Thread(target=lambda: first.append(
        creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB))))
    t.start()
    assert servers.reserving.wait(5)
    with pytest.raises(errors.RegionExists, match="being created"):
        creator.create(CreateRequest("job/p", 3 * MiB))          # without exist_ok: at once
    threading.Timer(0.2, servers.gate.set).start()
    started = time.monotonic()
    second = creator.create(CreateRequest("job/p", 3 * MiB), exist_ok=True)
    assert time.monotonic() - started >= 0.15                 # waited, not failed
    t.join(10)
    assert second.uid == first[0].uid  # type: ignore[attr-defined]


def test_exist_ok_after_a_failed_concurrent_create_creates(creator: RegionCreator,
                                                           servers: InMemoryServers) -> None:
    servers.gate = threading.Event()
    servers.fail_once["mem0:1"] = errors.OutOfMemory("full")
    failed: list[BaseException] = []

    def create() -> None:
        try:
            creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB))
        except errors.SMBError as exc:
            failed.append(exc)

    t = threading.Thread(target=create)
    t.start()
    assert servers.reserving.wait(5)
    threading.Timer(0.1, servers.gate.set).start()
    region = creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB), exist_ok=True)
    t.join(10)
    assert isinstance(failed[0], errors.OutOfMemory)   # the first one failed and rolled back,
    assert region.state == "ready"                     # then the waiting one created it
    assert servers.total() == 3


def test_exist_ok_gives_up_after_the_wait(state: ControllerState, servers: InMemoryServers) -> None:
    c = RegionCreator(state, servers, threads=4, exist_ok_wait=0.2)
    servers.gate = threading.Event()
    t = threading.Thread(target=lambda: c.create(CreateRequest("job/p", MiB)))
    t.start()
    try:
        assert servers.reserving.wait(5)
        with pytest.raises(errors.RegionExists, match="still being created after 0.2 s"):
            c.create(CreateRequest("job/p", MiB), exist_ok=True)
    finally:
        servers.gate.set()
        t.join(10)
        c.close()


def test_exist_ok_checks_the_existing_region(creator: RegionCreator) -> None:
    first = creator.create(CreateRequest("job/p", 2 * MiB))
    assert creator.create(CreateRequest("job/p", 2 * MiB), exist_ok=True).uid == first.uid
    with pytest.raises(errors.RegionExists, match="exists with 2097152 bytes, not 1048576"):
        creator.create(CreateRequest("job/p", MiB), exist_ok=True)
    with pytest.raises(errors.RegionExists, match="striped placement, not single"):
        creator.create(CreateRequest("job/p", 2 * MiB, placement="single"), exist_ok=True)
    with pytest.raises(errors.RegionExists, match="already exists"):
        creator.create(CreateRequest("job/p", 2 * MiB))


def test_delete_releases_and_skips_down_servers(creator: RegionCreator, servers: InMemoryServers,
                                                state: ControllerState) -> None:
    creator.create(CreateRequest("job/p", 6 * MiB, stripe_unit=MiB))
    state.expire_leases(now=time.time() + 2e9)  # every server down
    state.register_server("s0", "h0", "mem0:1", [], 64 * MiB, held=[])  # s0 back up
    creator.delete("job/p")
    assert servers.total() == 2                 # s1 and s2 are down: left as orphans
    with pytest.raises(errors.RegionNotFound):
        creator.delete("job/p")


def test_release_failures_are_logged_not_raised(creator: RegionCreator, servers: InMemoryServers,
                                                caplog: pytest.LogCaptureFixture) -> None:
    creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB))
    servers.release_fails = errors.ServerUnavailable("gone")
    creator.delete("job/p")
    assert "freed as an orphan" in caplog.text


def test_barriers_open_for_all_parties() -> None:
    b = Barriers()
    out: list[tuple[int, int]] = []
    threads = [threading.Thread(target=lambda: out.append(b.wait("job/b", 3, timeout=5)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(out) == [(0, 0), (0, 1), (0, 2)]
    with pytest.raises(errors.InvalidArgument, match="1 to 255 characters"):
        b.wait("x" * 256, 1)
    with pytest.raises(errors.BarrierTimeout):
        b.wait("job/b", 2, timeout=0.05)
    b.close()
    with pytest.raises(errors.ControllerUnavailable):
        b.wait("job/b", 1)


def test_a_repeated_create_of_one_uid_gets_the_region_it_made(creator: RegionCreator,
                                                              servers: InMemoryServers) -> None:
    uid = "ab" * 16
    first = creator.create(CreateRequest("job/u", 3 * MiB, stripe_unit=MiB, uid=uid))
    # the reply was lost (failover, timeout): the caller sends the same create again
    again = creator.create(CreateRequest("job/u", 3 * MiB, stripe_unit=MiB, uid=uid))
    assert again.uid == first.uid == uid and again.extent_ids == first.extent_ids
    assert servers.total() == 3                               # nothing reserved twice
    with pytest.raises(errors.RegionExists):                  # another caller's create
        creator.create(CreateRequest("job/u", 3 * MiB, uid="cd" * 16))


def test_a_repeat_arriving_while_its_first_attempt_runs_waits_for_it(creator: RegionCreator,
                                                                    servers: InMemoryServers) -> None:
    uid = "ef" * 16
    servers.gate = threading.Event()
    first: list[object] = []
    t = threading.Thread(target=lambda: first.append(
        creator.create(CreateRequest("job/w", 3 * MiB, stripe_unit=MiB, uid=uid))))
    t.start()
    assert servers.reserving.wait(5)
    with pytest.raises(errors.RegionExists, match="being created"):   # another caller: at once
        creator.create(CreateRequest("job/w", 3 * MiB, uid="01" * 16))
    threading.Timer(0.2, servers.gate.set).start()
    again = creator.create(CreateRequest("job/w", 3 * MiB, stripe_unit=MiB, uid=uid))
    t.join(10)
    assert again.uid == uid == first[0].uid  # type: ignore[attr-defined]


def test_a_repeated_delete_of_one_request_is_answered_as_done(creator: RegionCreator,
                                                              servers: InMemoryServers) -> None:
    creator.create(CreateRequest("job/d", 3 * MiB, stripe_unit=MiB))
    request = "a1" * 16
    creator.delete("job/d", request)
    assert servers.total() == 0
    creator.delete("job/d", request)                          # its reply was lost: done already
    with pytest.raises(errors.RegionNotFound):                 # another caller's delete
        creator.delete("job/d", "b2" * 16)
    with pytest.raises(errors.RegionNotFound):
        creator.delete("job/d")


def test_a_delete_retried_after_the_leader_died_before_releasing_frees_the_extents(
        creator: RegionCreator, servers: InMemoryServers, state: ControllerState) -> None:
    """The leader removed the region from the state, then died before releasing its
    extents: the retry (at the next leader, same state) is answered as done *and* frees
    them, so the old region's handles stop reaching its memory now, not at the orphan
    sweep."""
    region = creator.create(CreateRequest("job/e", 3 * MiB, stripe_unit=MiB))
    request = "c3" * 16
    state.delete_region("job/e", request)        # the state's half of the delete only
    assert servers.total() == 3
    creator.delete("job/e", request)
    assert servers.total() == 0
    assert sorted(servers.released) == sorted(e.extent_id for e in region.extents)
    creator.delete("job/e", request)             # once more: nothing left, still done
    assert servers.total() == 0


# -- replicated regions -------------------------------------------------------------------
def test_a_replicated_create_configures_backups_then_primaries(creator: RegionCreator,
                                                                servers: InMemoryServers,
                                                                state: ControllerState) -> None:
    region = creator.create(CreateRequest("job/r", 3 * MiB, stripe_unit=MiB, replicas=2))
    assert region.state == "ready" and region.replicas == 2 and len(region.extents) == 6
    assert servers.total() == 6                       # every copy reserved
    roles = [c[3] for c in servers.configured]
    assert roles == ["backup"] * 3 + ["primary"] * 3  # backups first
    for address, eid, view, role, backups in servers.configured:
        extent = next(e for e in region.extents if e.extent_id == eid)
        assert view == 1 and extent.grpc_address == address and role == extent.role
        if role == "primary":
            (other,) = [e for e in region.copies_of(extent.index) if e.role == "backup"]
            assert backups == [(other.extent_id, False)]    # fresh extents: nothing to sync
        else:
            assert backups == []


def test_an_unreplicated_create_configures_nothing(creator: RegionCreator, servers: InMemoryServers) -> None:
    creator.create(CreateRequest("job/p", 3 * MiB, stripe_unit=MiB, replicas=1))
    creator.create(CreateRequest("job/q", 3 * MiB, stripe_unit=MiB))
    assert servers.configured == [] and servers.total() == 6


def test_a_failed_configure_releases_every_copy(creator: RegionCreator, servers: InMemoryServers,
                                                state: ControllerState) -> None:
    servers.configure_fails["mem2:1"] = errors.ServerUnavailable("gone")
    with pytest.raises(errors.ServerUnavailable, match="s2.*nothing was created"):
        creator.create(CreateRequest("job/r", 3 * MiB, stripe_unit=MiB, replicas=2))
    assert servers.total() == 0
    with pytest.raises(errors.RegionNotFound):
        state.get_region("job/r")


def test_exist_ok_checks_the_copies_asked_for(creator: RegionCreator) -> None:
    creator.create(CreateRequest("job/r", MiB, replicas=2))
    assert creator.create(CreateRequest("job/r", MiB), exist_ok=True).replicas == 2
    with pytest.raises(errors.RegionExists, match="2 copies of every byte, not 3"):
        creator.create(CreateRequest("job/r", MiB, replicas=3), exist_ok=True)
