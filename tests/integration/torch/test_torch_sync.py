"""Synchronous training through the memory box equals one process training on the union
of the workers' batches (worker processes on a real local cluster)."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.integration.torch.ranks import release  # noqa: E402
from tests.integration.torch.training import rank_batch, sync_step, train_on_the_union  # noqa: E402

WORLD = 3
BATCH = 8       # per worker and step
STEPS = 6
LR = 0.1


def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_data():
    g = torch.Generator().manual_seed(99)
    x = torch.randn(STEPS * WORLD * BATCH, 10, generator=g)
    y = torch.randint(0, 4, (STEPS * WORLD * BATCH,), generator=g)
    return x, y


def sync_worker(address, token, prefix, rank, placement, overlap, queue, compression=None):
    try:
        import smb_client
        from smb_client.torch import SharedCounters, SyncDataParallel, WorkerEnv, open_store
        torch.set_num_threads(1)
        x, y = make_data()
        env = WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
        with smb_client.connect(address, token) as client:
            # every worker builds its model from a different seed: the master's weights win
            torch.manual_seed(rank)
            model = make_model() if rank == 0 else torch.nn.Sequential(
                torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                torch.nn.Linear(32, 4))
            store = open_store(client, env, prefix, model, placement=placement, grad_slots=3, workers=WORLD)
            # workers would stop at different counts; "fastest" stops all after STEPS steps
            counters = SharedCounters(store.region("counters"), rank, WORLD, "fastest", STEPS + rank,
                                      lockstep=True)
            dp = SyncDataParallel(store, rank, WORLD, overlap=overlap, counters=counters, bucket_bytes=1024,
                                  compression=compression)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            step = 0
            while not dp.stop:
                if step >= 2 * STEPS:
                    raise AssertionError("the stopping rule never fired")
                sync_step(dp, model, opt, x, y, rank_batch(step, rank, WORLD, BATCH))
                step += 1
            dp.close()
            client.barrier(f"{prefix}/end", WORLD, timeout=60)
            queue.put((rank, step, store.flat.flat_params.numpy().copy(), store.traffic.as_dict()))
            release(store, rank)
    except BaseException as exc:
        queue.put((rank, -1, repr(exc), None))
        raise


def reference():
    model = make_model()
    x, y = make_data()
    train_on_the_union(model, torch.optim.SGD(model.parameters(), lr=LR), x, y, STEPS, WORLD * BATCH)
    return model


def run_workers(cluster, name, placement, overlap, compression=None):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=sync_worker, args=(cluster.address, cluster.token, name, r, placement,
                                                    overlap, queue, compression)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return sorted(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("placement,overlap", [("striped", True), ("layered", False)])
def test_sync_equals_single_process_on_union_of_batches(cluster, name, placement, overlap):
    from smb_client.torch import FlatModel
    results = run_workers(cluster, name, placement, overlap)
    for rank, steps, params, _traffic in results:
        assert steps == STEPS, (rank, params)
    ref = FlatModel(reference()).flat_params.numpy()
    start = FlatModel(make_model()).flat_params.numpy()
    for _rank, _, params, traffic in results:
        assert np.array_equal(params, results[0][2])              # all replicas identical
        np.testing.assert_allclose(params, ref, rtol=1e-5, atol=1e-6)
        assert traffic["sent"] > 0 and traffic["received"] > 0
    assert np.abs(ref - start).max() > 1e-3                        # training moved the weights


@pytest.mark.parametrize("compression", ["bf16", "fp16-full"])
def test_16_bit_gradients_train_close_to_float32_and_every_replica_alike(cluster, name, compression):
    """Gradients sent as 16-bit values and summed in float32 on the servers: every
    replica ends with the same bytes, near the float32 reference (the pushes' rounding
    is all that differs), and not equal to it (the gradients did travel narrowed)."""
    from smb_client.torch import FlatModel
    results = run_workers(cluster, name, "striped", True, compression)
    ref = FlatModel(reference()).flat_params.numpy()
    start = FlatModel(make_model()).flat_params.numpy()
    moved = np.abs(ref - start).max()
    for rank, steps, params, _traffic in results:
        assert steps == STEPS, (rank, params)
        assert np.array_equal(params, results[0][2])
        assert np.abs(params - ref).max() < 0.02 * moved
    assert not np.array_equal(results[0][2], ref)


def test_compression_that_cannot_apply_is_refused(cluster, name):
    import smb_client
    from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
    from smb_protocol import errors
    env = WorkerEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    with smb_client.connect(cluster.address, cluster.token) as client:
        store = open_store(client, env, name, make_model(), grad_slots=3, workers=1)
        try:
            with pytest.raises(errors.InvalidArgument, match="unknown compression 'int8'"):
                SyncDataParallel(store, 0, 1, compression="int8", check_env=False)
            with pytest.raises(errors.InvalidArgument, match="needs the collective exchange"):
                SyncDataParallel(store, 0, 1, compression="bf16", exchange="slots", check_env=False)
            store16 = open_store(client, env, f"{name}16", make_model().half(), grad_slots=3, workers=1)
            try:
                with pytest.raises(errors.DtypeError, match="float16 chunks cannot travel as bfloat16"):
                    SyncDataParallel(store16, 0, 1, compression="bf16", check_env=False)
            finally:
                store16.destroy()
        finally:
            store.destroy()
