"""CUDA tensors through the memory box (needs a CUDA device; skipped without one).

Region operations, collectives, :class:`~smb_client.torch.SyncDataParallel` and DDP on
the ``smb`` backend with CUDA tensors, on a real local cluster; every result is compared
bit for bit with the CPU path (or, for training, with the same arithmetic done locally
on the device, and with DDP over gloo).
"""
from __future__ import annotations

import datetime
import os
import traceback

import numpy as np
import pytest

from smb_server.testing import spawn_ranks
from tests.integration.client.parties import run_parties
from tests.integration.daemons import free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")]

MiB = 1 << 20
WORLD = 2
STEPS = 3
BATCH = 16
LR = 0.05


def _produced_on_side_stream(n, dtype):
    """A tensor whose values a kernel on a side stream is still writing when the call
    comes (a long matmul first), and that stream."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(8):
            busy = busy @ busy / 64
        t = (torch.arange(n, device="cuda", dtype=torch.float64) % 1999 - 999).to(dtype)
    return t, side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_region_ops(client, name, dtype):
    n = (20 * MiB + 12) // torch.tensor([], dtype=dtype).element_size()   # several staging chunks
    t, side = _produced_on_side_stream(n, dtype)
    nbytes = n * t.element_size()
    region = client.create_region(name, nbytes)
    plain = client.create_region(name + "-cpu", nbytes)
    try:
        with torch.cuda.stream(side):          # the caller's stream is the side stream
            region.write(0, t)
        host = t.cpu()
        plain.write(0, host if dtype != torch.uint8 else host.numpy())
        assert bytes(region.read()) == bytes(plain.read())
        if dtype != torch.uint8:
            region.accumulate(0, t)
            plain.accumulate(0, host)
            region.axpy(0, t, 0.25)
            plain.axpy(0, host, 0.25)
            assert bytes(region.read()) == bytes(plain.read())
        with torch.cuda.stream(side):
            out = torch.full_like(t, 7)
            region.read_into(0, out)
            doubled = out.clone()                # on the side stream, after the copies
        want = torch.empty_like(host)
        plain.read_into(0, want if dtype != torch.uint8 else want.numpy())
        assert torch.equal(doubled.cpu(), want)
        out2 = torch.zeros_like(t)
        region.read_into_async(0, out2).result()
        assert torch.equal(out2.cpu(), want)
        region.write_async(0, torch.zeros_like(t)).result()
        assert not any(bytes(region.read(0, 4096)))
    finally:
        client.delete_region(name)
        client.delete_region(name + "-cpu")


def test_many_forms(client, name):
    a = torch.arange(1000, dtype=torch.float32, device="cuda")
    b = torch.arange(500, dtype=torch.int64)
    region = client.create_region(name, 1 << 16)
    try:
        region.write_many([(0, a), (8192, b)])
        region.accumulate_many([(0, a)])
        outs = region.read_many([(0, torch.zeros_like(a)), (8192, torch.zeros(500, dtype=torch.int64, device="cuda"))])
        assert torch.equal(outs[0].cpu(), 2 * a.cpu()) and torch.equal(outs[1].cpu(), b)
    finally:
        client.delete_region(name)


def test_collectives_match_the_cpu_path(cluster, name):
    parties, n = 3, 6 * MiB // 4
    inputs = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(r)).float()
              for r in range(parties)]
    runs = [(0, MiB), (2 * MiB, 3 * MiB)]
    got = {}

    def body(coll, rank):
        torch.cuda.set_device(0)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            dev = inputs[rank].cuda()
            coll.all_reduce(dev)
            got["whole", rank] = dev.cpu()
            piece = inputs[rank].cuda()
            rnd = coll.begin(piece, runs=runs, hold=0)
            for off in range(n * 4 - MiB, -1, -MiB):
                rnd.ready(off, MiB)
            rnd.finish()
            got["piece", rank] = piece.cpu()
            cpu = inputs[rank].clone()
            coll.begin(cpu, runs=runs, hold=0).finish()
            got["cpu", rank] = cpu
            b = inputs[rank].cuda()
            coll.broadcast(b, 2, rank)
            got["bcast", rank] = b.cpu()
    run_parties(cluster, name, parties, n * 4, None, None, body)
    total = inputs[0] + inputs[1] + inputs[2]
    for rank in range(parties):
        assert torch.equal(got["whole", rank], total)
        assert torch.equal(got["piece", rank], got["cpu", rank])
        assert torch.equal(got["bcast", rank], inputs[2])


# -- training ------------------------------------------------------------------------
def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.BatchNorm1d(256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def make_data():
    g = torch.Generator().manual_seed(99)
    n = STEPS * WORLD * BATCH
    return torch.randn(n, 64, generator=g), torch.randint(0, 8, (n,), generator=g)


def sync_worker(rank, queue, address, token, prefix):
    try:
        import smb_client
        from smb_client.torch import SyncDataParallel, WorkerEnv, open_store
        x, y = make_data()
        env = WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
        with smb_client.connect(address, token) as client:
            model = make_model().cuda()
            store = open_store(client, env, prefix, model, workers=WORLD)
            dp = SyncDataParallel(store, rank, WORLD, bucket_bytes=64 << 10, buffers="none", check_env=False)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for step in range(STEPS):
                lo = (step * WORLD + rank) * BATCH
                dp.zero_grad()
                torch.nn.functional.cross_entropy(model(x[lo:lo + BATCH].cuda()), y[lo:lo + BATCH].cuda()).backward()
                dp.synchronize()
                opt.step()
            dp.close()
            client.barrier(f"{prefix}/end", WORLD, timeout=60)
            queue.put((rank, store.flat.flat_params.cpu().numpy().copy()))
            if rank == 0:
                store.destroy()
            else:
                store.close()
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _reference_sync():
    """What the two workers compute, done in one process on the device: each worker's
    gradient, summed, times 1/world (batch-norm statistics stay per worker: the module
    runs per worker batch, its buffers are not exchanged in this check)."""
    from smb_client.torch.flat import FlatModel
    models = [make_model().cuda() for _ in range(WORLD)]
    flats = [FlatModel(m) for m in models]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    x, y = make_data()
    for step in range(STEPS):
        for rank in range(WORLD):
            lo = (step * WORLD + rank) * BATCH
            flats[rank].zero_grad()
            torch.nn.functional.cross_entropy(models[rank](x[lo:lo + BATCH].cuda()),
                                              y[lo:lo + BATCH].cuda()).backward()
        total = flats[0].flat_grads + flats[1].flat_grads
        for rank in range(WORLD):
            flats[rank].flat_grads.copy_(total * (1.0 / WORLD))
            opts[rank].step()
    return flats[0].flat_params.cpu().numpy()


def test_sync_data_parallel_cuda(cluster, name):
    results = spawn_ranks(WORLD, sync_worker, cluster.address, cluster.token, name, timeout=180)
    assert np.array_equal(results[0], results[1])
    assert np.array_equal(results[0], _reference_sync())


def ddp_worker(rank, queue, backend, init, address, token):
    try:
        os.environ.update(SMB_CONTROLLER=address, SMB_TOKEN=token)
        import torch.distributed as dist

        import smb_client.torch  # noqa: F401  (registers the backend)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        try:
            model = make_model().cuda()
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            x, y = make_data()
            for step in range(STEPS):
                lo = (step * WORLD + rank) * BATCH
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x[lo:lo + BATCH].cuda()), y[lo:lo + BATCH].cuda()).backward()
                opt.step()
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
            # batch-norm statistics: rank 0's broadcast before each forward, then this
            # rank's own batch, so they differ between ranks (as with any backend)
            buffers = torch.cat([b.detach().reshape(-1).double() for b in model.buffers()]).cpu()
        finally:
            dist.destroy_process_group()
        queue.put((rank, (params.numpy().copy(), buffers.numpy().copy())))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def test_ddp_on_the_smb_backend_equals_gloo(cluster):
    smb = spawn_ranks(WORLD, ddp_worker, "smb", f"tcp://127.0.0.1:{free_port()}", cluster.address, cluster.token,
                      timeout=180)
    gloo = spawn_ranks(WORLD, ddp_worker, "gloo", f"tcp://127.0.0.1:{free_port()}", cluster.address, cluster.token,
                       timeout=180)
    assert np.array_equal(smb[0][0], smb[1][0])
    for rank in range(WORLD):
        assert np.array_equal(smb[rank][0], gloo[rank][0])
        assert np.array_equal(smb[rank][1], gloo[rank][1])


def _elastic_update(client, name, model):
    """One SEASGD elastic update of ``model`` against global weights another (CPU) worker
    moved by +4; the model's and the store's weights after it, on the host."""
    from smb_client.torch import SEASGD, ParameterStore

    store = ParameterStore.create(client, name, model, scheme="seasgd", workers=2)
    try:
        other = torch.nn.Linear(64, 32)
        other.load_state_dict({k: v.detach().cpu() + 4 for k, v in model.state_dict().items()})
        writer = ParameterStore.attach(client, name, other, pull=False)
        writer.push_params()
        ea = SEASGD(store, rank=0, world=2, moving_rate=0.25, update_interval=1)
        assert ea.after_step() is True
        ea.finish()
        ea.close()
        writer.close()
        return ({k: v.detach().cpu() for k, v in model.state_dict().items()},
                {k: v.cpu() for k, v in store.state_dict().items()})
    finally:
        store.destroy()


def test_seasgd_elastic_update_of_a_cuda_model(client, name):
    """SEASGD's elastic update of a CUDA model gives, bit for bit, what the same update
    of the same model on the CPU gives, on both sides (the local and the global weights)."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(64, 32)
    cuda_model = torch.nn.Linear(64, 32)
    cuda_model.load_state_dict(cpu_model.state_dict())
    cuda_model = cuda_model.cuda()
    start = {k: v.clone() for k, v in cpu_model.state_dict().items()}
    on_cpu = _elastic_update(client, name + "-cpu", cpu_model)
    on_cuda = _elastic_update(client, name, cuda_model)
    assert all(p.is_cuda for p in cuda_model.parameters())
    for side in (0, 1):
        for k, v in on_cpu[side].items():
            assert torch.equal(on_cuda[side][k], v), (side, k)
    assert not torch.equal(on_cpu[0]["weight"], start["weight"])     # the update moved something
