"""A wait that lasts says what it waits for, and one whose parties never all come raises
PartiesMissing naming how many came and who did not: memory-server barriers, controller
barriers and collective rounds, on a real local cluster."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from smb_client import Barrier, Collective
from smb_client.coord import Attendance, PartiesMissing, controller_barrier
from smb_protocol import errors

KiB = 1 << 10
BARRIER = 0          # byte offset of the barrier word
ROLL = 64            # byte offset of the attendance words
REPORT = 0.2         # seconds between reports in these tests


@pytest.fixture
def region(client, name):
    r = client.create_region(name, 4 * KiB, placement="single")
    yield r
    client.delete_region(name)


def _reports(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and what in r.getMessage()]


@contextmanager
def rank_0_alone(client, name: str, region) -> Iterator[Collective]:
    """A collective ``name`` of two parties (rounds time out after 1.5 s) that only rank 0
    takes part in, its attendance kept in ``region``; destroyed afterwards."""
    coll = Collective.create(client, name, 4 * KiB, 2, timeout=1.5)
    try:
        roll = Attendance(region, ROLL, 2, 0)
        roll.reset()
        coll.roll, coll.report_every = roll, REPORT
        yield coll
    finally:
        coll.destroy()


def test_a_barrier_names_the_rank_that_never_came(client, region, caplog):
    parties = 3
    rolls = [Attendance(region, ROLL, parties, r) for r in range(parties)]
    rolls[0].reset()
    errs: dict[int, BaseException] = {}

    def arrive(rank: int) -> None:
        barrier = Barrier(region, BARRIER, parties, name="barrier job/step", roll=rolls[rank], report_every=REPORT)
        try:
            barrier.wait(timeout=1.5)
        except BaseException as exc:
            errs[rank] = exc

    first = threading.Thread(target=arrive, args=(1,), daemon=True)
    first.start()
    region.wait(BARRIER, value=1, timeout=30)          # rank 1 is in; rank 2 never comes
    with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
        arrive(0)
    first.join(30)
    for rank in (0, 1):
        exc = errs[rank]
        assert isinstance(exc, PartiesMissing) and isinstance(exc, errors.BarrierTimeout)
        assert exc.arrived == 2 and exc.parties == 3 and exc.missing == [2]
        assert "barrier job/step, generation 0: 2 of 3 parties arrived" in str(exc)
        assert "missing: rank 2" in str(exc)
    reports = _reports(caplog, "barrier job/step")
    assert any("2 of 3 arrived" in m and "missing: rank 2" in m for m in reports), reports


def test_a_barrier_without_attendance_still_counts(client, region):
    barrier = Barrier(region, BARRIER, 2, report_every=REPORT)
    with pytest.raises(PartiesMissing) as info:
        barrier.wait(timeout=0.5)
    assert info.value.arrived == 1 and info.value.missing is None
    assert f"barrier at byte {BARRIER} of {region.name}" in str(info.value)


def test_a_completed_barrier_reports_nothing(client, region, caplog):
    rolls = [Attendance(region, ROLL, 2, r) for r in range(2)]
    rolls[0].reset()
    done = threading.Event()

    def other() -> None:
        Barrier(region, BARRIER, 2, roll=rolls[1]).wait(timeout=30)
        done.set()
    t = threading.Thread(target=other, daemon=True)
    t.start()
    with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
        assert Barrier(region, BARRIER, 2, roll=rolls[0]).wait(timeout=30) == 0
    t.join(30)
    assert done.is_set() and not _reports(caplog, "barrier")
    assert rolls[0].missing() == [] and rolls[1].missing() == []


def test_attendance_words_must_fit_the_region(region):
    with pytest.raises(errors.InvalidArgument, match="do not fit"):
        Attendance(region, region.size - 8, 2, 0)
    with pytest.raises(errors.InvalidArgument, match="rank 2 outside"):
        Attendance(region, ROLL, 2, 2)


def test_a_controller_barrier_says_how_many_came(client, name, caplog):
    with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
        with pytest.raises(PartiesMissing) as info:
            controller_barrier(client, f"{name}/ready", 2, timeout=1.0, report_every=REPORT)
    assert info.value.arrived == 1 and info.value.parties == 2 and info.value.missing is None
    assert f"barrier {name}/ready: 1 of 2 parties arrived" in str(info.value)
    assert any("1 of 2 arrived" in m for m in _reports(caplog, f"barrier {name}/ready"))


def test_a_controller_barrier_that_opens_returns_its_generation(client, name):
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(controller_barrier(client, name, 2, timeout=30,
                                                                      report_every=REPORT)), daemon=True)
    t.start()
    assert controller_barrier(client, name, 2, timeout=30, report_every=REPORT) == 0
    t.join(30)
    assert got == [0]


def test_a_collective_round_names_the_rank_that_never_came(client, name, region, caplog):
    with rank_0_alone(client, f"{name}/c", region) as coll:
        with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
            with pytest.raises(PartiesMissing) as info:
                coll.all_reduce(np.ones(512, dtype=np.float32))
        exc = info.value
        assert isinstance(exc, errors.Timeout)
        assert exc.arrived == 1 and exc.parties == 2 and exc.missing == [1]
        assert f"all-reduce on {name}/c, round 0: 1 of 2 parties arrived" in str(exc)
        assert any("1 of 2 arrived" in m and "missing: rank 1" in m
                   for m in _reports(caplog, f"all-reduce on {name}/c"))
        with pytest.raises(PartiesMissing, match="every party must make a new one"):
            coll.all_reduce(np.ones(512, dtype=np.float32))


def test_a_broadcast_whose_root_never_comes_names_it(client, name, region, caplog):
    with rank_0_alone(client, f"{name}/b", region) as coll:
        with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
            with pytest.raises(PartiesMissing) as info:
                coll.broadcast(np.zeros(512, dtype=np.float32), root=1, rank=0)
        assert info.value.missing == [1] and info.value.parties == 2
        assert f"broadcast from rank 1 on {name}/b, round 0: not every party came" in str(info.value)
        assert any("2 parties expected" in m and "missing: rank 1" in m
                   for m in _reports(caplog, f"broadcast from rank 1 on {name}/b"))


def test_a_controller_barrier_names_the_rank_that_never_came(client, name, caplog):
    with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
        with pytest.raises(PartiesMissing) as info:
            controller_barrier(client, f"{name}/ready", 3, timeout=1.0, rank=1, report_every=REPORT)
    assert info.value.missing == [0, 2] and info.value.arrived == 1
    assert str(info.value).endswith("; missing: rank 0, 2")
    assert any("1 of 3 arrived" in m and "missing: rank 0, 2" in m for m in _reports(caplog, f"barrier {name}/ready"))
    with pytest.raises(errors.InvalidArgument, match="rank 3 is not among 3 parties"):
        client.barrier(f"{name}/ready", 3, timeout=1.0, rank=3)
