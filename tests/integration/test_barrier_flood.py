"""A flood of blocking Barrier calls from one token holder leaves the control plane
working: memory servers keep their lease, short calls are answered, and the waits
beyond the limit are refused at once as busy."""
from __future__ import annotations

import threading
import time

from smb_client import errors, rpc
from smb_client._proto.smb.v1 import controller_pb2 as pb
from smb_client._proto.smb.v1 import controller_pb2_grpc as pb_grpc
from smb_server.controller.barriers import MAX_WAITERS

FLOOD = 70            # more than the controller's barrier waits and handler threads of old
WAIT_SECONDS = 8.0    # each flooding call waits this long (more than two leases)
CHANNELS = 7


def test_barrier_flood_does_not_starve_heartbeats(fresh_cluster):
    cluster = fresh_cluster
    assert cluster.lease_seconds * 2 < WAIT_SECONDS
    channels = [rpc.channel(cluster.address) for _ in range(CHANNELS)]
    stubs = [pb_grpc.ControllerStub(ch) for ch in channels]
    outcomes: list[str] = []
    lock = threading.Lock()

    def flood(i: int) -> None:
        request = pb.BarrierRequest(name="flood/never", parties=1000, timeout_seconds=WAIT_SECONDS)
        try:
            rpc.call(stubs[i % CHANNELS].Barrier, request, cluster.token, WAIT_SECONDS + 10)
            what = "opened"
        except errors.BarrierTimeout:
            what = "waited"
        except errors.ControllerUnavailable as exc:
            what = "busy" if "busy" in str(exc) else f"unavailable: {exc}"
        except errors.SMBError as exc:
            what = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(what)

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(FLOOD)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        deadline = time.monotonic() + WAIT_SECONDS - 1.0
        with cluster.client(timeout=2.0, reconnect_timeout=0.0) as c:
            while time.monotonic() < deadline:
                started = time.monotonic()
                states = {s.server_id: s.state for s in c.list_servers()}
                assert time.monotonic() - started < 1.0, "a short call waited behind the flood"
                assert list(states.values()) == ["up"] * cluster.num_servers, states
                time.sleep(0.2)
        for t in threads:
            t.join(WAIT_SECONDS + 15)
    finally:
        for ch in channels:
            ch.close()
    assert sorted(set(outcomes)) == ["busy", "waited"], outcomes
    assert outcomes.count("waited") == MAX_WAITERS and outcomes.count("busy") == FLOOD - MAX_WAITERS
    with cluster.client() as c:
        assert {s.state for s in c.list_servers()} == {"up"}
