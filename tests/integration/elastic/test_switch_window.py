"""The window of a move's switch, made to last: the controller already lists a slot's
extent where it will be, but its memory server still refuses mutations (NotPrimary:
it is configured as a backup until the switch is applied). An unreplicated region's
handle runs the operation again until the server takes it, never fails on the
refusal, and applies it once. Real controller, memory server and client processes;
the switch is held open by configuring the server through its admin API."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from smb_protocol import rpc, tickets
from smb_protocol._proto.smb.v1 import memory_server_pb2 as pb
from smb_protocol._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
from smb_server.commands.local_cluster import LocalCluster

MiB = 1 << 20


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster")) as c:
        yield c


def configure(cluster: LocalCluster, route, view: int, role: str) -> None:
    place = route.extents[0]
    secret = bytes.fromhex(cluster.secret_file.read_text().strip())
    admin = tickets.sign(secret, route.uid, [place.extent_id], "admin", ttl=600)[0]
    channel = rpc.channel(place.grpc_address)
    try:
        rpc.call(pb_grpc.MemoryServerStub(channel).ConfigureReplicas,
                 pb.ConfigureReplicasRequest(ticket=admin, extent_id=place.extent_id, view=view, role=role),
                 None, 30)
    finally:
        channel.close()


class Reruns(logging.Handler):
    """Set when the route says it runs an operation again."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "running the operation again" in record.getMessage():
            self.seen.set()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_refusal_during_the_switch_is_run_again_not_reported(cluster, transport):
    reruns = Reruns()
    logger = logging.getLogger("smb_client.route")
    logger.addHandler(reruns)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with cluster.client(transport=transport) as c:
            region = c.create_region("job/w", MiB)
            counter = region.fetch_add(0, 1)
            configure(cluster, region.route, 1, "backup")   # the switch begins: refused there
            outcome: dict[str, object] = {}

            def mutate() -> None:
                try:
                    outcome["old"] = region.fetch_add(0, 1)
                    region.write(8, np.arange(16, dtype=np.int64))
                except BaseException as exc:   # reported below
                    outcome["error"] = exc
            t = threading.Thread(target=mutate)
            t.start()
            while not reruns.seen.wait(0.05):
                assert t.is_alive(), f"the refusal was reported: {outcome.get('error')!r}"
            configure(cluster, region.route, 2, "")           # the switch applied
            t.join(60)
            assert not t.is_alive()
            assert "error" not in outcome, outcome["error"]
            assert outcome["old"] == counter + 1
            assert int(region.read(0, 8, dtype=np.int64)[0]) == counter + 2    # applied once
            np.testing.assert_array_equal(region.read(8, 128, dtype=np.int64), np.arange(16))
    finally:
        logger.removeHandler(reruns)
        logger.setLevel(level)
