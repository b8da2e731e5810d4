"""A controller Barrier of 8 parties across a kill -9 of the leader in the middle of a
round: every party returns once all have arrived, none returns early, none hangs, and
the generation goes on from where the dead leader left it; an arrival whose reply was
lost in a failover is not counted twice. Real etcd, three real controller processes."""
from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from smb_protocol._proto.smb.v1 import controller_pb2 as pb
from smb_server.testing import ControllerGroup, EtcdServer

PARTIES = 8
EARLY = 4          # parties that arrive before the kill
BARRIER_WAIT = 60  # seconds a party waits at most (the test fails rather than hangs)


@pytest.fixture
def group(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[ControllerGroup]:
    with ControllerGroup(tmp_path, etcd_server.url(), count=3, leader_lease=2) as g:
        yield g


def test_a_barrier_survives_a_leader_kill_in_the_middle_of_a_round(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    clients = [group.client(reconnect_timeout=BARRIER_WAIT) for _ in range(PARTIES)]
    first_round = threading.Barrier(PARTIES + 1)
    early_called = threading.Semaphore(0)
    late_go = threading.Event()
    results: list[tuple[int, bool] | BaseException] = [RuntimeError("no answer")] * PARTIES

    def party(k: int) -> None:
        c = clients[k]
        try:
            assert c.barrier("train/step", PARTIES, timeout=BARRIER_WAIT) == 0
            first_round.wait(BARRIER_WAIT)
            if k < EARLY:
                early_called.release()
            else:
                assert late_go.wait(BARRIER_WAIT)
            generation = c.barrier("train/step", PARTIES, timeout=BARRIER_WAIT)
            results[k] = (generation, late_go.is_set())   # returned after the late ones came?
        except BaseException as exc:
            results[k] = exc

    threads = [threading.Thread(target=party, args=(k,), daemon=True) for k in range(PARTIES)]
    try:
        for t in threads:
            t.start()
        first_round.wait(BARRIER_WAIT)           # round 0 opened at the first leader
        for _ in range(EARLY):
            assert early_called.acquire(timeout=BARRIER_WAIT)
        # the early half is (or is about to be) waiting in round 1 at the leader: kill it
        group.kill(leader)
        group.wait_leader(timeout=BARRIER_WAIT, among=tuple(i for i in range(3) if i != leader))
        late_go.set()
        for t in threads:
            t.join(BARRIER_WAIT + 15)
        assert not any(t.is_alive() for t in threads), "a party hangs"
        # every party passed round 1 at the new leader, in generation 1, and none before
        # the late half arrived
        assert results == [(1, True)] * PARTIES
    finally:
        late_go.set()
        for c in clients:
            c.close()


def test_an_arrival_whose_reply_was_lost_in_a_failover_counts_once(group: ControllerGroup) -> None:
    leader = group.wait_leader()
    with group.client(reconnect_timeout=BARRIER_WAIT) as one, group.client(reconnect_timeout=BARRIER_WAIT) as two:
        got: list[int | BaseException] = []

        def wait_one() -> None:
            try:
                got.append(one.barrier("train/lost", 2, timeout=BARRIER_WAIT))
            except BaseException as exc:
                got.append(exc)
        # round 0 opens with two's arrival; then its reply is lost: the leader dies and
        # two sends the same request (the same arrival id) again, as its retry would
        late = pb.BarrierRequest(name="train/lost", parties=2, timeout_seconds=BARRIER_WAIT,
                                 arrival_id=uuid.uuid4().hex)
        first = threading.Thread(target=wait_one, daemon=True)
        first.start()
        opened = two._call("Barrier", late, timeout=BARRIER_WAIT + 10)
        first.join(BARRIER_WAIT)
        assert got == [0] and opened.generation == 0
        group.kill(leader)
        group.wait_leader(timeout=BARRIER_WAIT, among=tuple(i for i in range(3) if i != leader))
        # one waits in round 1; two's retry is answered from round 0 at once, not counted in round 1
        second = threading.Thread(target=wait_one, daemon=True)
        second.start()
        again = two._call("Barrier", late, timeout=BARRIER_WAIT + 10)
        assert (again.generation, again.arrival) == (opened.generation, opened.arrival)
        assert got == [0]                       # round 1 has not opened on the retry
        assert two.barrier("train/lost", 2, timeout=BARRIER_WAIT) == 1
        second.join(BARRIER_WAIT)
        assert got == [0, 1]
