"""A flood of blocking Barrier calls from one token holder leaves the control plane
working: memory servers keep their lease, short calls are answered, and the waits
beyond the limit are refused at once as busy."""
from __future__ import annotations

import threading
import time

import grpc

from smb_protocol import errors, rpc
from smb_protocol._proto.smb.v1 import controller_pb2 as pb
from smb_protocol._proto.smb.v1 import controller_pb2_grpc as pb_grpc
from smb_server.controller.barriers import MAX_WAITERS, MAX_WAITERS_PER_CALLER
from smb_server.testing import wait_until

FLOOD = 70            # more than the controller's barrier waits and handler threads of old
WAIT_SECONDS = 8.0    # each flooding call waits this long (more than two leases)
CHANNELS = 7


def _connection(address: str) -> grpc.Channel:
    """A channel with a connection of its own (channels share connections by default),
    so that the controller sees a caller of its own."""
    return grpc.insecure_channel(address, options=[*rpc.CHANNEL_OPTIONS,
                                                   ("grpc.use_local_subchannel_pool", 1)])


def _flood(stubs: list, token: str, count: int, parties: int, seconds: float,
           name: str = "flood/never", outcomes: list[str] | None = None) -> list[str]:
    """``count`` Barrier calls to ``name`` at once, spread over ``stubs``; how each ended,
    appended to ``outcomes`` (when given) as each one ends."""
    outcomes = [] if outcomes is None else outcomes
    lock = threading.Lock()

    def one(i: int) -> None:
        request = pb.BarrierRequest(name=name, parties=parties, timeout_seconds=seconds)
        try:
            rpc.call(stubs[i % len(stubs)].Barrier, request, token, seconds + 10)
            what = "opened"
        except errors.BarrierTimeout:
            what = "waited"
        except errors.ControllerBusy:
            what = "busy"
        except errors.SMBError as exc:
            what = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(what)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 15)
    return outcomes


def test_one_caller_gets_a_share_of_the_barrier_waits(cluster):
    one, other = _connection(cluster.address), _connection(cluster.address)
    try:
        outcomes: list[str] = []
        flood = threading.Thread(target=_flood, args=(
            [pb_grpc.ControllerStub(one)], cluster.token, MAX_WAITERS_PER_CALLER + 4, 1000, 3.0,
            "flood/one-caller", outcomes))
        flood.start()
        # refused only while the caller's share already waits: then every wait is in
        wait_until(lambda: outcomes.count("busy") == 4, "the caller's share to wait", 3.0, pause=0.01)
        # another connection still gets its barriers through while the first one is capped
        pair = _flood([pb_grpc.ControllerStub(other)], cluster.token, 2, 2, 2.0, name="flood/pair")
        flood.join()
    finally:
        one.close()
        other.close()
    assert pair == ["opened", "opened"]
    assert outcomes.count("waited") == MAX_WAITERS_PER_CALLER and outcomes.count("busy") == 4, outcomes


def test_barrier_flood_does_not_starve_heartbeats(fresh_cluster):
    cluster = fresh_cluster
    assert cluster.lease_seconds * 2 < WAIT_SECONDS
    channels = [_connection(cluster.address) for _ in range(CHANNELS)]
    outcomes: list[str] = []
    flood = threading.Thread(target=_flood, args=(
        [pb_grpc.ControllerStub(ch) for ch in channels], cluster.token, FLOOD, 1000, WAIT_SECONDS,
        "flood/never", outcomes))
    try:
        flooded = time.monotonic()
        flood.start()
        # the calls beyond the limit are refused only once the limit's worth waits
        wait_until(lambda: outcomes.count("busy") == FLOOD - MAX_WAITERS, "the flood to fill the barrier waits",
                   WAIT_SECONDS / 2, pause=0.01)
        deadline = flooded + WAIT_SECONDS - 0.5
        with cluster.client(timeout=2.0, reconnect_timeout=0.0) as c:
            while time.monotonic() < deadline:
                started = time.monotonic()
                states = {s.server_id: s.state for s in c.list_servers()}
                assert time.monotonic() - started < 1.0, "a short call waited behind the flood"
                assert list(states.values()) == ["up"] * cluster.num_servers, states
                time.sleep(0.2)
        flood.join()
    finally:
        for ch in channels:
            ch.close()
    assert sorted(set(outcomes)) == ["busy", "waited"], outcomes
    assert outcomes.count("waited") == MAX_WAITERS and outcomes.count("busy") == FLOOD - MAX_WAITERS
    with cluster.client() as c:
        assert {s.state for s in c.list_servers()} == {"up"}
