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

WORLD = 2


def big() -> torch.nn.Module:
    return torch.nn.Linear(1024, 1024)   # 4 MiB per slot


def test_others_get_the_masters_creation_error_within_seconds(cluster, name):
    outcome: dict[int, tuple[BaseException | None, float]] = {}

    def worker(rank: int, delay: float) -> None:
        time.sleep(delay)
        t0 = time.monotonic()
        try:
            with cluster.client() as c:
                # 400 gradient slots of 4 MiB: more than the cluster's two 512 MiB servers
                store = open_store(c, WorkerEnv(rank=rank, world_size=WORLD), name, big(),
                                   grad_slots=400, workers=WORLD)
                store.close()
            outcome[rank] = (None, time.monotonic() - t0)
        except BaseException as exc:   # noqa: BLE001 - checked below
            outcome[rank] = (exc, time.monotonic() - t0)

    # rank 1 is already waiting when the master fails
    threads = [threading.Thread(target=worker, args=(1, 0.0)), threading.Thread(target=worker, args=(0, 1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    master_error, _ = outcome[0]
    error, waited = outcome[1]
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
        results: dict[int, object] = {}

        def worker(rank: int) -> None:
            try:
                with cluster.client() as wc:
                    if rank == 0:
                        time.sleep(1.5)
                    s = open_store(wc, WorkerEnv(rank=rank, world_size=WORLD), name, big(), workers=WORLD)
                    results[rank] = True
                    wc.barrier(f"{name}/done", WORLD, timeout=30)
                    if rank == 0:
                        s.destroy()
                    else:
                        s.close()
            except BaseException as exc:   # noqa: BLE001 - checked below
                results[rank] = exc

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {0: True, 1: True}, results


def test_a_worker_that_never_comes_is_named(cluster, name):
    with cluster.client() as c:
        with pytest.raises(PartiesMissing) as info:
            open_store(c, WorkerEnv(rank=0, world_size=3), name, torch.nn.Linear(4, 2), ready_timeout=1.5)
        assert info.value.missing == [1, 2] and "missing: rank 1, 2" in str(info.value)
        ParameterStore.destroy_prefix(c, name)
