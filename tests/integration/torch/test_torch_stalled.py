"""A worker that never comes to a step: the others say what they wait for while they
wait, and fail with PartiesMissing naming it (SyncDataParallel with either exchange,
and the smb torch.distributed backend; a real local cluster)."""
from __future__ import annotations

import datetime
import logging
import threading

import pytest

torch = pytest.importorskip("torch")

from smb_client.coord import PartiesMissing  # noqa: E402
from smb_client.torch import ParameterStore, SyncDataParallel  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import rank_store  # noqa: E402
from tests.integration.torch.test_backend import run_processes  # noqa: E402

WORLD = 2
REPORT = 0.2         # seconds between reports in these tests


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.fixture
def quick_reports(monkeypatch):
    monkeypatch.setattr("smb_client.coord.REPORT_EVERY", REPORT)
    monkeypatch.setattr("smb_client.collective.REPORT_EVERY", REPORT)


@pytest.mark.parametrize("exchange", ["collective", "slots"])
def test_a_worker_that_stops_coming_is_named(cluster, name, exchange, quick_reports, caplog):
    """Rank 1 trains two steps, then stays away; rank 0's third step fails naming it."""
    models = [make_model() for _ in range(WORLD)]
    ready, gone, failed = threading.Event(), threading.Event(), threading.Event()

    def worker(rank: int) -> PartiesMissing | None:
        try:
            with cluster.client() as c:
                model = models[rank]
                slots = {"grad_slots": 3} if exchange == "slots" else {}
                store = rank_store(c, rank, name, model, ready, workers=WORLD, **slots)
                dp = SyncDataParallel(store, rank, WORLD, exchange=exchange, barrier_timeout=60)
                assert dp.roll is not None
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
                try:
                    for step in range(3 if rank == 0 else 2):
                        if step == 2:                         # rank 0 alone: this wait is to time out
                            dp.barrier_timeout = 2.0
                            if dp.collective is not None:
                                dp.collective.timeout = 2.0
                        opt.zero_grad()
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                        opt.step()
                except PartiesMissing as exc:
                    return exc                        # rank 0's third step: what the test checks
                if rank == 1:
                    gone.set()
                    assert failed.wait(60)        # alive, but never at step 3
                dp.close(publish=False)
                store.close()
                return None
        finally:
            ready.set()
            if rank == 0:
                failed.set()

    with caplog.at_level(logging.WARNING, logger="smb_client.coord"):
        outcome = run_ranks(WORLD, worker, timeout=90)
    try:
        assert outcome[1] is None and gone.is_set()
        exc = outcome[0]
        assert isinstance(exc, PartiesMissing), repr(exc)
        assert exc.missing == [1] and exc.arrived == 1 and exc.parties == WORLD
        assert "missing: rank 1" in str(exc)
        reports = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("1 of 2 arrived" in m and "missing: rank 1" in m for m in reports), reports
    finally:
        with cluster.client() as c:
            ParameterStore.destroy_prefix(c, name)
            c.delete_regions(name + "/")


def _one_rank_stays_away(rank, world):
    import torch.distributed as dist

    import smb_client.collective
    import smb_client.coord
    smb_client.coord.REPORT_EVERY = smb_client.collective.REPORT_EVERY = REPORT
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(4))                       # both: the collective exists
    out = {}
    if rank == 0:
        for coll in dist.distributed_c10d._get_default_group().collectives.values():
            coll.timeout = 2.0                           # this wait is to time out
        work = dist.all_reduce(torch.ones(4), async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.3))
        except Exception as exc:
            out["early"] = (type(exc).__name__, str(exc))
        try:
            work.wait()
        except PartiesMissing as exc:
            out["error"] = (exc.missing, exc.arrived, str(exc))
        store.set("test/rank0-done", "1")
    else:
        store.wait(["test/rank0-done"], datetime.timedelta(seconds=60))
    return out


def test_a_backend_rank_that_stays_away_is_named(cluster):
    results = run_processes(cluster, _one_rank_stays_away, WORLD)
    kind, text = results[0]["early"]
    assert kind == "Timeout" and "all_reduce not finished within 0.3 s" in text
    missing, arrived, text = results[0]["error"]
    assert missing == [1] and arrived == 1 and "missing: rank 1" in text


def _wait_with_timeout(rank, world):
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((3,), float(rank + 1))
    out = {}
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.2))
        except Exception as exc:
            out["early"] = type(exc).__name__
        store.set("test/come", "1")                      # now rank 1 comes
        out["finished"] = work.wait(timeout=datetime.timedelta(seconds=60))
    else:
        store.wait(["test/come"], datetime.timedelta(seconds=60))
        dist.all_reduce(t)
    out["sum"] = t.tolist()
    return out


def test_work_wait_honours_its_timeout(cluster):
    results = run_processes(cluster, _wait_with_timeout, WORLD)
    assert results[0]["early"] == "Timeout" and results[0]["finished"] is True
    assert results[0]["sum"] == results[1]["sum"] == [3.0, 3.0, 3.0]
