"""The Controller service in-process on loopback, with tiny real gRPC memory servers."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from smb_protocol import errors, rpc, tickets
from smb_protocol._proto.smb.v1 import controller_pb2 as pb
from smb_protocol._proto.smb.v1 import controller_pb2_grpc, memory_server_pb2, memory_server_pb2_grpc
from smb_server.controller.main import Controller
from smb_server.runtime.config import ControllerConfig
from smb_server.runtime.credentials import admin_credential, server_credential
from smb_server.runtime.grpc_util import typed_errors

MiB = 1 << 20
TOKEN = "test-token"
SECRET = b"s" * 32
TIMEOUT = 10.0


class FakeMemoryServer(memory_server_pb2_grpc.MemoryServerServicer):
    """Records ReserveExtent/ReleaseExtent calls after checking their admin tickets.

    ``fail`` set to an SMBError makes every ReserveExtent raise it.
    """

    def __init__(self) -> None:
        self.reserved: dict[int, tuple[str, int]] = {}
        self.released: list[int] = []
        self.views: dict[int, int] = {}
        self.configured: list[tuple[int, int, str, list[tuple[int, bool]]]] = []
        self.fail: errors.SMBError | None = None
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        memory_server_pb2_grpc.add_MemoryServerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _check(self, token: str, extent_id: int) -> tickets.Ticket:
        ticket = tickets.verify(SECRET, token)
        if ticket.mode != "admin" or extent_id not in ticket.extent_ids:
            raise errors.PermissionDenied("not an admin ticket for this extent")
        return ticket

    @typed_errors
    def ReserveExtent(self, request: Any, context: grpc.ServicerContext) -> Any:
        ticket = self._check(request.ticket, request.extent_id)
        assert ticket.region_uid == request.region_uid
        if self.fail is not None:
            raise self.fail
        with self.lock:
            self.reserved[request.extent_id] = (request.region_uid, request.length)
        return memory_server_pb2.ReserveExtentResponse(extent_id=request.extent_id, length=request.length)

    @typed_errors
    def ReleaseExtent(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.ticket, request.extent_id)
        with self.lock:
            self.released.append(request.extent_id)
            held = self.reserved.pop(request.extent_id, None) is not None
        return memory_server_pb2.ReleaseExtentResponse(released=held)

    @typed_errors
    def ConfigureReplicas(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.ticket, request.extent_id)
        with self.lock:
            if request.extent_id not in self.reserved:
                raise errors.ExtentNotFound(f"extent {request.extent_id} is not held")
            view = self.views.get(request.extent_id, 0)
            if request.view < view:
                raise errors.InvalidArgument(f"view {request.view} is older than {view}")
            self.views[request.extent_id] = request.view
            self.configured.append((request.extent_id, request.view, request.role,
                                    [(b.extent_id, b.sync) for b in request.backups]))
            synced = sum(self.reserved[request.extent_id][1] for b in request.backups if b.sync)
        return memory_server_pb2.ConfigureReplicasResponse(view=request.view, synced_bytes=synced)

    def stop(self) -> None:
        self.server.stop(0).wait()


def start_controller(tmp_path: Path, lease: float = 5.0) -> Controller:
    cfg = ControllerConfig(listen="127.0.0.1:0", db_path=str(tmp_path / "controller.db"),
                           token=TOKEN, lease_seconds=lease, orphan_grace_seconds=30.0,
                           ready_file=str(tmp_path / "controller.ready"))
    cfg.secret = SECRET
    return Controller(cfg).start()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    c = start_controller(tmp_path)
    yield c
    c.stop()


@pytest.fixture
def stub(controller: Controller) -> Iterator[controller_pb2_grpc.ControllerStub]:
    channel = rpc.channel(controller.address)
    yield controller_pb2_grpc.ControllerStub(channel)
    channel.close()


@pytest.fixture
def memservers() -> Iterator[list[FakeMemoryServer]]:
    servers = [FakeMemoryServer(), FakeMemoryServer()]
    yield servers
    for s in servers:
        s.stop()


def call(stub: Any, method: str, request: Any, token: str = TOKEN, timeout: float = TIMEOUT) -> Any:
    """One call; with the default token, memory-server calls carry the credential of the
    server they name and DrainServer the admin credential (as in a real cluster)."""
    if token == TOKEN and method in ("RegisterServer", "Heartbeat", "UnregisterServer"):
        token = server_credential(SECRET, request.server_id)
    elif token == TOKEN and method == "DrainServer":
        token = admin_credential(SECRET)
    return rpc.call(getattr(stub, method), request, token, timeout)


def register(stub: Any, server_id: str, address: str, capacity: int = 64 * MiB) -> Any:
    return call(stub, "RegisterServer", pb.RegisterServerRequest(
        server_id=server_id, host_id="h-" + server_id, grpc_address=address,
        endpoints=[f"tcp://{address}"], capacity_bytes=capacity))


def test_lifecycle_and_ready_file(tmp_path: Path) -> None:
    with start_controller(tmp_path) as c:
        assert c.status == "running"
        ready = json.loads((tmp_path / "controller.ready").read_text())
        assert ready == {"address": c.address} and not c.address.endswith(":0")
    assert c.status == "closed"
    assert not (tmp_path / "controller.ready").exists()
    c.stop()  # idempotent


def test_bad_token_is_authentication_error(stub: Any) -> None:
    with pytest.raises(errors.AuthenticationError):
        call(stub, "ListServers", pb.ListServersRequest(), token="wrong")
    with pytest.raises(errors.AuthenticationError):
        call(stub, "ListServers", pb.ListServersRequest(), token=None)  # type: ignore[arg-type]


def test_register_heartbeat_list_drain(stub: Any) -> None:
    reply = register(stub, "s1", "127.0.0.1:1")
    assert reply.server_id == "s1" and reply.lease_seconds == 5.0 and not reply.orphan_extent_ids
    (info,) = call(stub, "ListServers", pb.ListServersRequest()).servers
    assert (info.server_id, info.host_id, info.capacity_bytes, info.state) == ("s1", "h-s1", 64 * MiB, "up")
    assert list(info.endpoints) == ["tcp://127.0.0.1:1"]
    hb = call(stub, "Heartbeat", pb.HeartbeatRequest(server_id="s1", extents=[
        pb.HeldExtent(extent_id=42, region_uid="x", length=MiB, age_seconds=31.0)]))
    assert list(hb.orphan_extent_ids) == [42]
    with pytest.raises(errors.ServerNotFound):
        call(stub, "Heartbeat", pb.HeartbeatRequest(server_id="nobody"))
    drained = call(stub, "DrainServer", pb.DrainServerRequest(server_id="s1")).server
    assert drained.state == "draining"
    with pytest.raises(errors.ServerNotFound):
        call(stub, "DrainServer", pb.DrainServerRequest(server_id="nobody"))


def test_create_with_no_servers_is_out_of_memory(stub: Any) -> None:
    with pytest.raises(errors.OutOfMemory):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/x", size=MiB))
    with pytest.raises(errors.RegionNotFound):
        call(stub, "OpenRegion", pb.OpenRegionRequest(name="job/x"))


def test_create_open_delete(stub: Any, memservers: list[FakeMemoryServer]) -> None:
    for i, m in enumerate(memservers):
        register(stub, f"s{i}", m.address)
    resp = call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/params", size=4 * MiB,
                                                             stripe_unit=MiB))
    region = resp.region
    assert region.state == "ready" and region.size == 4 * MiB and region.placement == "striped"
    assert [e.length for e in region.extents] == [2 * MiB, 2 * MiB]
    by_address = {m.address: m for m in memservers}
    for e in region.extents:
        assert by_address[e.grpc_address].reserved[e.extent_id] == (region.uid, e.length)
        assert e.server_state == "up" and e.endpoints == [f"tcp://{e.grpc_address}"]
    ids = {e.extent_id for e in region.extents}
    ticket = tickets.verify(SECRET, resp.ticket.token)
    assert ticket.mode == resp.ticket.mode == "rw" and ticket.extent_ids == ids
    assert ticket.region_uid == region.uid

    opened = call(stub, "OpenRegion", pb.OpenRegionRequest(name="job/params", mode="ro"))
    assert opened.region == region
    assert tickets.verify(SECRET, opened.ticket.token).mode == "ro"
    with pytest.raises(errors.InvalidArgument):
        call(stub, "OpenRegion", pb.OpenRegionRequest(name="job/params", mode="admin"))
    with pytest.raises(errors.RegionExists):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/params", size=4 * MiB))
    again = call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/params", size=4 * MiB,
                                                              exist_ok=True))
    assert again.region.uid == region.uid
    with pytest.raises(errors.RegionExists, match="bytes"):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/params", size=MiB, exist_ok=True))

    servers = call(stub, "ListServers", pb.ListServersRequest()).servers
    assert [s.used_bytes for s in servers] == [2 * MiB, 2 * MiB] and [s.extents for s in servers] == [1, 1]
    assert [r.name for r in call(stub, "ListRegions", pb.ListRegionsRequest(prefix="job/")).regions] \
        == ["job/params"]

    call(stub, "DeleteRegion", pb.DeleteRegionRequest(name="job/params"))
    assert sorted(memservers[0].released + memservers[1].released) == sorted(ids)
    assert not memservers[0].reserved and not memservers[1].reserved
    assert call(stub, "ListRegions", pb.ListRegionsRequest()).regions == []
    with pytest.raises(errors.RegionNotFound):
        call(stub, "DeleteRegion", pb.DeleteRegionRequest(name="job/params"))


def test_failed_reserve_rolls_back(stub: Any, memservers: list[FakeMemoryServer]) -> None:
    good, bad = memservers
    register(stub, "good", good.address)
    register(stub, "bad", bad.address)
    bad.fail = errors.OutOfMemory("arena full")
    with pytest.raises(errors.OutOfMemory, match="bad"):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/p", size=4 * MiB, stripe_unit=MiB))
    assert not good.reserved and len(good.released) == 1
    assert call(stub, "ListRegions", pb.ListRegionsRequest()).regions == []
    assert all(s.used_bytes == 0 for s in call(stub, "ListServers", pb.ListServersRequest()).servers)


def test_unreachable_server_is_unavailable(stub: Any, memservers: list[FakeMemoryServer]) -> None:
    register(stub, "good", memservers[0].address)
    memservers[1].stop()
    register(stub, "dead", memservers[1].address)
    with pytest.raises(errors.ServerUnavailable, match="dead"):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/p", size=4 * MiB, stripe_unit=MiB))
    assert not memservers[0].reserved
    with pytest.raises(errors.InvalidArgument):
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="bad//name", size=MiB))


def test_lease_expiry_degrades_region(tmp_path: Path, memservers: list[FakeMemoryServer]) -> None:
    with start_controller(tmp_path, lease=0.4) as c:
        channel = rpc.channel(c.address)
        stub = controller_pb2_grpc.ControllerStub(channel)
        register(stub, "a", memservers[0].address)
        register(stub, "b", memservers[1].address)
        call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/p", size=2 * MiB, stripe_unit=MiB))
        deadline = time.monotonic() + 5
        while True:  # "a" heartbeats, "b" stays silent
            call(stub, "Heartbeat", pb.HeartbeatRequest(server_id="a"))
            states = {s.server_id: s.state for s in call(stub, "ListServers", pb.ListServersRequest()).servers}
            if states["b"] == "down":
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.05)
        assert states["a"] == "up"
        (region,) = call(stub, "ListRegions", pb.ListRegionsRequest()).regions
        assert region.state == "degraded"
        channel.close()


def test_barrier_three_threads(stub: Any) -> None:
    results: list[Any] = []

    def party() -> None:
        results.append(call(stub, "Barrier", pb.BarrierRequest(name="step", parties=3,
                                                                timeout_seconds=10)))

    for generation in range(2):
        threads = [threading.Thread(target=party) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert sorted(r.arrival for r in results) == [0, 1, 2]
        assert {r.generation for r in results} == {generation}
        results.clear()


def test_barrier_timeout_and_bad_arguments(stub: Any) -> None:
    start = time.monotonic()
    with pytest.raises(errors.BarrierTimeout, match="1 of 2"):
        call(stub, "Barrier", pb.BarrierRequest(name="lonely", parties=2, timeout_seconds=0.3))
    assert time.monotonic() - start < 5
    with pytest.raises(errors.InvalidArgument):
        call(stub, "Barrier", pb.BarrierRequest(name="zero", parties=0, timeout_seconds=1))
    # the timed-out waiter does not count: a single party opens a 1-party barrier
    assert call(stub, "Barrier", pb.BarrierRequest(name="lonely", parties=1)).arrival == 0

    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            call(stub, "Barrier", pb.BarrierRequest(name="mixed", parties=2, timeout_seconds=1.0))
        except errors.SMBError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    with pytest.raises(errors.InvalidArgument, match="2 parties"):
        call(stub, "Barrier", pb.BarrierRequest(name="mixed", parties=3, timeout_seconds=1))
    thread.join(5)
    assert [type(e) for e in outcome] == [errors.BarrierTimeout]


def test_barrier_forgets_callers_that_went_away(stub: Any) -> None:
    # the client gives up (gRPC deadline) while the barrier itself would wait forever
    with pytest.raises(errors.Timeout):
        call(stub, "Barrier", pb.BarrierRequest(name="ghost", parties=2), timeout=0.2)
    time.sleep(0.8)  # longer than the servicer's liveness poll
    with pytest.raises(errors.BarrierTimeout, match="1 of 2"):
        call(stub, "Barrier", pb.BarrierRequest(name="ghost", parties=2, timeout_seconds=0.2))


def test_restart_keeps_regions(tmp_path: Path, memservers: list[FakeMemoryServer]) -> None:
    with start_controller(tmp_path) as c:
        channel = rpc.channel(c.address)
        stub = controller_pb2_grpc.ControllerStub(channel)
        register(stub, "a", memservers[0].address)
        first = call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/p", size=MiB)).region
        channel.close()
    with start_controller(tmp_path) as c:
        channel = rpc.channel(c.address)
        stub = controller_pb2_grpc.ControllerStub(channel)
        again = call(stub, "OpenRegion", pb.OpenRegionRequest(name="job/p")).region
        assert again.uid == first.uid and [e.extent_id for e in again.extents] == \
            [e.extent_id for e in first.extents]
        channel.close()


def test_a_replicated_region_names_its_copies_and_is_repaired(tmp_path: Path) -> None:
    servers = [FakeMemoryServer() for _ in range(3)]
    try:
        with start_controller(tmp_path, lease=0.5) as c:
            channel = rpc.channel(c.address)
            stub = controller_pb2_grpc.ControllerStub(channel)
            register(stub, "a", servers[0].address)
            register(stub, "b", servers[1].address)
            reply = call(stub, "CreateRegion", pb.CreateRegionRequest(
                name="job/r", size=2 * MiB, stripe_unit=MiB, replicas=2))
            info = reply.region
            assert info.replicas == 2 and info.state == "ready"
            assert [(e.index, e.role, e.view) for e in info.extents] == [(0, "primary", 1), (1, "primary", 1)]
            assert sorted((e.index, e.role) for e in info.copies) == [(0, "backup"), (1, "backup")]
            for e in info.extents:   # each slot's copies on both servers
                (other,) = [x for x in info.copies if x.index == e.index]
                assert other.server_id != e.server_id and other.length == e.length
            every = {e.extent_id for e in list(info.extents) + list(info.copies)}
            assert tickets.verify(SECRET, reply.ticket.token).extent_ids == every
            assert sum(len(s.configured) for s in servers) == 4
            with pytest.raises(errors.InvalidArgument, match="replicas"):
                call(stub, "CreateRegion", pb.CreateRegionRequest(name="job/x", size=MiB, replicas=4))
            # "a" goes silent: the region is repaired onto "c" from the copies on "b"
            register(stub, "c", servers[2].address)
            deadline = time.monotonic() + 15
            while True:
                for sid in ("b", "c"):
                    call(stub, "Heartbeat", pb.HeartbeatRequest(server_id=sid))
                info = call(stub, "OpenRegion", pb.OpenRegionRequest(name="job/r")).region
                placed = {e.server_id for e in list(info.extents) + list(info.copies)}
                if info.state == "ready" and placed == {"b", "c"}:
                    break
                assert time.monotonic() < deadline, (info.state, placed)
                time.sleep(0.05)
            assert {e.server_id for e in info.extents} <= {"b", "c"} and len(info.copies) == 2
            assert all(e.view >= 4 for e in info.extents)
            synced = [b for s in servers for (_, _, role, bs) in s.configured for b in bs if b[1]]
            assert len(synced) == 2     # each slot copied once to "c"
            metrics = c.registry.render()
            assert 'smb_controller_repairs_total{kind="spare"} 2.0' in metrics
            channel.close()
    finally:
        for s in servers:
            s.stop()
