"""A route stays bound to its region's incarnation (uid) on every path that opens the
region again, and its data plane follows a server to the endpoints listed last (no
network: a scripted controller answers)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from smb_client.dataplane import DataPlane
from smb_client.route import Route
from smb_protocol import errors
from smb_protocol.placement import ExtentPlace
from smb_protocol.tickets import TicketMode

SIZE = 4096


def _info(uid: str, replicas: int = 1, port: int = 1) -> SimpleNamespace:
    extents = [SimpleNamespace(extent_id=7, server_id="s1", length=SIZE, grpc_address="h:9", host_id="hostA",
                               endpoints=[f"tcp://127.0.0.1:{port}"], server_state="up", index=0, copy=0,
                               role="primary" if replicas > 1 else "")]
    copies = [SimpleNamespace(extent_id=8, server_id="s2", length=SIZE, grpc_address="h:8", host_id="hostA",
                              endpoints=["tcp://127.0.0.1:2"], server_state="up", index=0, copy=1,
                              role="backup")] if replicas > 1 else []
    return SimpleNamespace(name="job/r", uid=uid, size=SIZE, placement="single", stripe_unit=0, state="ready",
                           extents=extents, replicas=replicas, copies=copies, segment_sizes=[],
                           segment_servers=[])


def _ticket(token: str) -> SimpleNamespace:
    return SimpleNamespace(token=token, expires_at=time.time() + 3600)


class Controller:
    """Answers OpenRegion with the region described last; counts the calls."""

    def __init__(self, info: SimpleNamespace) -> None:
        self.info = info
        self.opened = 0
        self.dataplane = DataPlane("tcp", "hostA", connections=1)
        self.chunk_bytes = 1 << 20

    def open_info(self, name, mode=TicketMode.RW, reconnect_timeout=None):
        self.opened += 1
        return self.info, _ticket(f"t{self.opened}")

    def delete_region(self, name):
        raise AssertionError("not used")


@pytest.fixture
def controller():
    c = Controller(_info("old"))
    yield c
    c.dataplane.close()


def _route(controller, replicas: int = 1) -> Route:
    controller.info = _info("old", replicas)
    return Route(controller, controller.info, _ticket("t0"), TicketMode.RW)


def _refused_from_now_on(route: Route) -> None:
    calls = []
    for _ in range(2):
        with pytest.raises(errors.RegionNotFound, match="another one"):
            route.run(lambda: calls.append(1))
    assert not calls                   # nothing reaches a server once the name is another region's
    assert route.uid == "old" and route.ticket != "t-new"


def test_refresh_never_adopts_another_incarnation(controller):
    route = _route(controller)
    controller.info = _info("new")                  # deleted, and created again under its name
    with pytest.raises(errors.RegionNotFound, match="uid old"):
        route.refresh()
    _refused_from_now_on(route)


def test_renewal_before_expiry_never_adopts_another_incarnation(controller):
    route = _route(controller)
    route.expires_at = 0.0
    controller.info = _info("new")
    _refused_from_now_on(route)


@pytest.mark.parametrize("replicas", [1, 2])
def test_renewal_after_ticket_expired_never_adopts_another_incarnation(controller, replicas):
    route = _route(controller, replicas)
    controller.info = _info("new", replicas)

    def expired():
        raise errors.TicketExpired("expired")
    with pytest.raises(errors.RegionNotFound):
        route.run(expired)
    _refused_from_now_on(route)


@pytest.mark.parametrize("error", [errors.ServerUnavailable, errors.NotPrimary, errors.ExtentNotFound])
def test_failover_never_adopts_another_incarnation(controller, error):
    """A replicated region reopens itself after a failed server, a demoted primary or a
    replaced copy: the answer for another incarnation ends the route."""
    route = _route(controller, replicas=2)
    controller.info = _info("new", replicas=2)
    calls = []

    def failing():
        calls.append(1)
        raise error("gone")
    with pytest.raises(errors.RegionNotFound):
        route.run(failing)
    assert len(calls) == 1
    _refused_from_now_on(route)


@pytest.mark.parametrize("error", [errors.ServerUnavailable, errors.ExtentNotFound])
def test_explaining_an_error_never_adopts_another_incarnation(controller, error):
    route = _route(controller)
    controller.info = _info("new")

    def failing():
        raise error("gone")
    with pytest.raises(errors.RegionNotFound, match="another one") as info:
        route.run(failing)
    assert isinstance(info.value.__cause__, error)
    _refused_from_now_on(route)


def test_same_incarnation_at_new_endpoints_is_followed(controller):
    """A controller failover or a restarted server answers with the same uid: adopted,
    and the data plane's session for the server moves to the endpoint listed now."""
    route = _route(controller)
    before = route.session(route.extents[0])
    assert list(controller.dataplane.sessions()) == ["tcp://127.0.0.1:1"]
    controller.info = _info("old", port=3)
    route.refresh()
    assert route.ticket == "t1" and route.uid == "old"
    after = route.session(route.extents[0])
    assert after is not before and list(controller.dataplane.sessions()) == ["tcp://127.0.0.1:3"]
    stale = _info("old", port=1)   # a place described before still reaches the server where it is now
    assert controller.dataplane.session(ExtentPlace.from_message(stale.extents[0])) is after
    assert route.run(lambda: 42) == 42


def test_shm_arithmetic_follows_its_server_to_the_tcp_endpoint_listed_now():
    """The shm session of a server that restarted on a new tcp port (same socket path)
    stays; its arithmetic goes to the new port, and the old tcp session is closed."""
    dp = DataPlane("shm", "hostA", connections=1)
    try:
        def place(port: int) -> ExtentPlace:
            return ExtentPlace(7, "s1", SIZE, "h:9", "hostA", (f"tcp://127.0.0.1:{port}", "shm:///nowhere.sock"),
                               "up")
        dp.learn([place(1)])
        shm = dp.session(place(1))
        old_tcp = dp.coordination(place(1))
        with pytest.raises(errors.ServerUnavailable, match=r"127\.0\.0\.1:1\b"):
            shm.fetch_add("t", 7, 0, 1)
        dp.learn([place(3)])
        dp.learn([ExtentPlace(7, "s1", SIZE, "h:9", "hostA", (), "down")])   # says nothing of endpoints
        assert dp.session(place(1)) is shm
        assert set(dp.sessions()) == {"shm:///nowhere.sock"} and old_tcp.pool.closed
        with pytest.raises(errors.ServerUnavailable, match=r"127\.0\.0\.1:3\b"):
            shm.fetch_add("t", 7, 0, 1)
        assert set(dp.sessions()) == {"shm:///nowhere.sock", "tcp://127.0.0.1:3"}
    finally:
        dp.close()
