"""A failed store creation reaches the waiting workers within seconds, as the master's
own error class (worker threads with their own clients on a real local cluster)."""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from smb_client.coord import PartiesMissing  # noqa: E402
from smb_client.torch import ParameterStore, WorkerEnv, open_store  # noqa: E402
from smb_protocol.errors import OutOfMemory  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402
from tests.integration.torch.ranks import release  # noqa: E402

WORLD = 2


def big() -> torch.nn.Module:
    return torch.nn.Linear(1024, 1024)   # 4 MiB per slot


def _waiting_worker(client, waiting: threading.Event):
    """``client``, whose barrier calls set ``waiting`` first: a worker that is there to
    wait for the master (the master's barrier opens them)."""
    barrier = client.barrier

    def announced(*args, **kwargs):
        waiting.set()
        return barrier(*args, **kwargs)
    client.barrier = announced
    return client


def test_others_get_the_masters_creation_error_within_seconds(cluster, name):
    waiting = threading.Event()

    def worker(rank: int) -> tuple[BaseException | None, float]:
        if rank == 0:
            assert waiting.wait(30)           # rank 1 is already waiting when the master fails
        t0 = time.monotonic()
        try:
            with cluster.client() as c:
                # 400 gradient slots of 4 MiB: more than the cluster's two 512 MiB servers
                store = open_store(_waiting_worker(c, waiting) if rank else c, WorkerEnv(rank=rank, world_size=WORLD),
                                   name, big(), grad_slots=400, workers=WORLD)
                store.close()
            return None, time.monotonic() - t0
        except BaseException as exc:   # noqa: BLE001 - checked below
            return exc, time.monotonic() - t0
        finally:
            waiting.set()

    (master_error, _), (error, waited) = run_ranks(WORLD, worker, timeout=60)
    assert isinstance(master_error, OutOfMemory), master_error
    assert isinstance(error, OutOfMemory), error
    assert "master failed to create parameter store" in str(error) and "OutOfMemory" in str(error)
    assert waited < 10, waited
    with cluster.client() as c:
        # ParameterStore.attach reads the record too
        t0 = time.monotonic()
        with pytest.raises(OutOfMemory, match="master failed"):
            ParameterStore.attach(c, name, big(), timeout=60)
        assert time.monotonic() - t0 < 5
        # the failed creation left only the record, and a new creation removes it
        assert [r.name for r in c.list_regions(name)] == [f"{name}/failed"]
        store = ParameterStore.create(c, name, big(), workers=WORLD)
        try:
            attached = ParameterStore.attach(c, name, big())
            attached.close()
        finally:
            store.destroy()
        assert c.list_regions(name) == []


def test_an_old_failure_record_does_not_fail_a_new_run(cluster, name, monkeypatch):
    from smb_client.torch import failure
    with cluster.client() as c:
        ParameterStore.publish_failure(c, name, OutOfMemory("long ago"))
        monkeypatch.setattr(failure, "SKEW", -5.0)   # the record counts as a previous run's
        waiting = threading.Event()

        def worker(rank: int) -> bool:
            try:
                with cluster.client() as wc:
                    if rank == 0:
                        assert waiting.wait(30)   # rank 1 saw the old record and waits on
                    s = open_store(_waiting_worker(wc, waiting) if rank else wc,
                                   WorkerEnv(rank=rank, world_size=WORLD), name, big(), workers=WORLD)
                    wc.barrier(f"{name}/done", WORLD, timeout=30)
                    release(s, rank)
                    return True
            finally:
                waiting.set()

        assert run_ranks(WORLD, worker, timeout=60) == [True, True]


def test_a_worker_that_never_comes_is_named(cluster, name):
    with cluster.client() as c:
        with pytest.raises(PartiesMissing) as info:
            open_store(c, WorkerEnv(rank=0, world_size=3), name, torch.nn.Linear(4, 2), ready_timeout=1.5)
        assert info.value.missing == [1, 2] and "missing: rank 1, 2" in str(info.value)
        ParameterStore.destroy_prefix(c, name)
