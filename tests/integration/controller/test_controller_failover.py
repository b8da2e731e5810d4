"""Several controllers on one etcd: one leads, the others stand by and name it; kill -9
the leader and a standby leads within the lease, with every acknowledged region intact
and no deleted one back; a paused leader that resumes after a standby took over can
change nothing. Real etcd, real controller and memory server processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from smb_client import Client
from smb_protocol import errors, rpc, tickets
from smb_protocol._proto.smb.v1 import memory_server_pb2, memory_server_pb2_grpc
from smb_server.testing import ControllerGroup, EtcdServer, wait_until

LEADER_LEASE = 2      # seconds
TAKEOVER_LIMIT = 10.0  # seconds: the target for a standby to lead after the leader died
MiB = 1 << 20


@pytest.fixture
def group(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[ControllerGroup]:
    with ControllerGroup(tmp_path, etcd_server.url(), count=2, leader_lease=LEADER_LEASE) as g:
        yield g


def test_one_leads_and_the_standby_names_it(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    standby = 1 - leader
    record = group.leader_record()
    assert record is not None and record["address"] == group.addresses[leader]
    with pytest.raises(errors.ControllerUnavailable, match=f"leader is at {group.addresses[leader]}"):
        with group.client(standby) as c:
            c.list_regions()
    with group.client(leader) as c:
        assert c.list_regions() == []
    # smb status, given both, says which leads
    out = subprocess.run([sys.executable, "-m", "smb_server.commands.cli", "status", "--controller",
                          ",".join(group.addresses)], env=dict(os.environ, SMB_TOKEN=group.token),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"controller {group.addresses[leader]}: SERVING (leader)" in out.stdout
    assert f"controller {group.addresses[standby]}: SERVING (standby)" in out.stdout


def test_kill_the_leader_a_standby_leads_with_every_acknowledged_region(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    group.start_server()
    kept, deleted = {}, []
    with group.client(leader, reconnect_timeout=5) as c:
        for i in range(12):
            region = c.create_region(f"job/r{i}", MiB, placement="single")
            kept[region.name] = region.uid
        for i in range(0, 12, 3):
            c.delete_region(f"job/r{i}")
            deleted.append(f"job/r{i}")
            del kept[f"job/r{i}"]
        epoch = group.leader_record()["epoch"]  # type: ignore[index]
    group.kill(leader)
    killed = time.monotonic()
    new = group.wait_leader(timeout=TAKEOVER_LIMIT + 5, among=(1 - leader,))
    took = time.monotonic() - killed
    assert took < TAKEOVER_LIMIT, f"the standby led only after {took:.1f} s"
    record = group.leader_record()
    assert record is not None and record["epoch"] == epoch + 1 and record["address"] == group.addresses[new]
    with group.client(new) as c:
        regions = {r.name: r for r in c.list_regions("job/")}
        assert sorted(regions) == sorted(kept)
        for name in deleted:
            with pytest.raises(errors.RegionNotFound):
                c.open_region(name)
        # the memory server found the new leader: regions stay ready, new ones can be made
        deadline = time.monotonic() + 10
        while {s.state for s in c.list_servers()} != {"up"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [s.state for s in c.list_servers()] == ["up"]
        for name, uid in kept.items():
            region = c.open_region(name)
            assert region.uid == uid and region.state == "ready"
            region.write(0, b"still here")
            assert bytes(region.read(0, 10)) == b"still here"
        c.create_region("job/after", MiB)  # reserved with the new epoch's admin ticket
        server = c.list_servers()[0].grpc_address
    # the memory server now refuses admin tickets of the dead leader's epoch
    secret = bytes.fromhex(group.secret_file.read_text())
    with grpc.insecure_channel(server) as channel:
        stub = memory_server_pb2_grpc.MemoryServerStub(channel)

        def reserve(extent_id: int, epoch: int) -> None:
            ticket, _ = tickets.sign(secret, "uid-x", [extent_id], "admin", epoch=epoch)
            rpc.call(stub.ReserveExtent, memory_server_pb2.ReserveExtentRequest(
                ticket=ticket, extent_id=extent_id, region_uid="uid-x", length=4096), "", 10)

        with pytest.raises(errors.InvalidTicket, match="deposed"):
            reserve(991, epoch)
        reserve(992, epoch + 1)


def test_a_paused_leader_resumed_after_a_takeover_changes_nothing(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    group.start_server()
    with group.client(leader, reconnect_timeout=5) as c:
        c.create_region("job/before", MiB)
    # a client given both, talking to the leader when it is paused
    listed = Client(f"{group.addresses[leader]},{group.addresses[1 - leader]}", group.token,
                    timeout=2, reconnect_timeout=TAKEOVER_LIMIT + 5)
    listed.list_regions()
    group.kill(leader, signal.SIGSTOP)
    try:
        new = group.wait_leader(timeout=TAKEOVER_LIMIT + 5, among=(1 - leader,))
        # the paused leader does not answer: the client gives up on it and finds the new one
        assert [r.name for r in listed.list_regions("job/")] == ["job/before"]
        assert listed.controller == group.addresses[new]
    finally:
        group.kill(leader, signal.SIGCONT)
        listed.close()
    # at once after it resumes, the old leader refuses and applies nothing; it names the new
    # leader as soon as its view of the election caught up (on a loaded machine the first
    # refusals may still say that no leader is known yet)
    named: list[str] = []
    with group.client(leader) as c:
        def refused_naming_the_new_leader() -> bool:
            with pytest.raises(errors.ControllerUnavailable) as refused:
                c.create_region("job/from-the-old-leader", MiB)
            named[:] = [str(refused.value)]
            return f"leader is at {group.addresses[new]}" in named[0]
        wait_until(refused_naming_the_new_leader, "the resumed leader to name the new one", 15, pause=0.05)
        with pytest.raises(errors.ControllerUnavailable):
            c.delete_region("job/before")
    with group.client(new) as c:
        assert [r.name for r in c.list_regions("job/")] == ["job/before"]
    # never two leaders: only the new one serves, the old one stays a standby
    assert [group.answers(i) for i in (leader, new)] == [False, True]
    time.sleep(LEADER_LEASE)
    assert [group.answers(i) for i in (leader, new)] == [False, True]
    record = group.leader_record()
    assert record is not None and record["address"] == group.addresses[new]


def test_a_client_given_the_list_follows_the_leader(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    group.start_server()
    standby = 1 - leader
    # the standby first in the list: the client moves on to the leader by itself
    listed = f"{group.addresses[standby]},{group.addresses[leader]}"
    with Client(listed, group.token, reconnect_timeout=TAKEOVER_LIMIT + 5) as c:
        region = c.create_region("job/followed", MiB)
        region.write(0, b"before")
        group.kill(leader)
        # the data plane never touches the controller: it works while none leads
        assert bytes(region.read(0, 6)) == b"before"
        region.write(0, b"during")
        # control calls wait for the standby to lead, then go to it
        c.create_region("job/after-failover", MiB)
        assert [r.name for r in c.list_regions("job/")] == ["job/after-failover", "job/followed"]
        assert c.controller == group.addresses[standby]
        again = c.open_region("job/followed")
        assert bytes(again.read(0, 6)) == b"during"
