"""The hybrid scheme with its node groups on the ``smb`` backend: the node's gradient
sums go through the memory box, optionally as 16-bit values (``compression=``), and
every step's seconds by phase are kept (2 simulated nodes × 2 workers in processes on a
real local cluster; the world itself on gloo)."""
from __future__ import annotations

import contextlib
import os
import traceback

import numpy as np
import pytest

from smb_server.testing import spawn_ranks
from tests.integration.daemons import free_port

torch = pytest.importorskip("torch")

WORLD, NODE_SIZE = 4, 2
STEPS, INTERVAL, BATCH = 4, 3, 16
RUNS = (None, "bf16")


class Scalars:
    """What a SummaryWriter is given: (tag, value, step) in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.got.append((tag, float(value), step))


def train_run(client, env, prefix, rank, ranks, groups, compression, profiled):
    """One hybrid training of STEPS steps; what the test compares."""
    from torch.profiler import ProfilerActivity, profile

    from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, open_store
    node, local, nodes = rank // NODE_SIZE, rank % NODE_SIZE, WORLD // NODE_SIZE
    torch.manual_seed(0)     # one start for both runs, so that they compare
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    flat = FlatModel(model)
    # the weights after each part of the set-up: a start that differs between the runs
    # names the part that changed it
    stages = {"made": flat.flat_params.numpy().copy()}
    store = seasgd = None
    if local == 0:
        store = open_store(client, env, prefix, flat, members=nodes, creator=node == 0,
                           scheme="hybrid", workers=nodes)
        seasgd = SEASGD(store, node, nodes, moving_rate=0.4, update_interval=INTERVAL)
        # every leader has loaded the stored start before any trains: SEASGD does not wait
        # for the other node, and a leader that loaded after node 0's first elastic update
        # would start from the global weights as they were then, not from the seed's
        client.barrier(f"{prefix}/loaded", nodes, timeout=60)
    stages["stored"] = flat.flat_params.numpy().copy()
    writer = Scalars()
    hy = HybridSEASGD(flat, groups[node], ranks[node], seasgd=seasgd, compression=compression,
                      bucket_bytes=4096, writer=writer if rank == 0 else None)
    stages["hybrid"] = flat.flat_params.numpy().copy()
    hy.broadcast_params()
    g = torch.Generator().manual_seed(1000 + rank)   # every worker its own data
    x = torch.randn(STEPS * BATCH, 32, generator=g)
    y = x[:, :4].argmax(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    out = {"wire": hy.wire, "losses": [], "after": [], "start": flat.flat_params.numpy().copy(), "stages": stages}
    prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
    with prof if prof is not None else contextlib.nullcontext():
        for step in range(STEPS):
            hy.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[step * BATCH:(step + 1) * BATCH]),
                                                     y[step * BATCH:(step + 1) * BATCH])
            loss.backward()
            hy.synchronize()
            opt.step()
            hy.after_step()
            out["losses"].append(loss.item())
            out["after"].append(flat.flat_params.numpy().copy())
        stop = hy.agree(rank == 0)
    hy.close()
    out.update(stop=stop, steps=hy.times.steps, total=dict(hy.times.total), last=dict(hy.times.last),
               scalars=writer.got,
               ranges=sorted({e.name for e in prof.events() if e.name.startswith("smb::")}) if prof else [])
    if store is not None:
        out["center"] = seasgd.global_weights.numpy().copy()   # the last global weights read
        seasgd.close()
        client.barrier(f"{prefix}/end", nodes, timeout=60)
        store.destroy() if node == 0 else store.close()
    return out


def hybrid_worker(rank, queue, address, token, port, prefix):
    try:
        os.environ.update(SMB_CONTROLLER=address, SMB_TOKEN=token)
        import torch.distributed as dist

        import smb_client
        from smb_client.torch import WorkerEnv, new_node_groups
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        ranks, groups = new_node_groups(WORLD, NODE_SIZE, backend="smb")
        env = WorkerEnv(rank=rank, world_size=WORLD, local_world_size=NODE_SIZE)
        out = {"backend": dist.get_backend(groups[rank // NODE_SIZE])}
        with smb_client.connect(address, token) as client:
            for compression in RUNS:
                out[compression] = train_run(client, env, f"{prefix}/{compression}", rank, ranks, groups,
                                             compression, profiled=rank == 0 and compression is not None)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _nearest(weights, run):
    """Which weights of the first run ``weights`` lies nearest (largest difference), to
    name where a second run's start came from."""
    seen = {f"rank {r} {what}": w for r, out in run.items()
            for what, w in [("start", out["start"]), ("center", out.get("center")),
                            *((f"after step {s + 1}", a) for s, a in enumerate(out["after"]))] if w is not None}
    far = {what: float(np.abs(weights - w).max()) for what, w in seen.items()}
    nearest = sorted(far.items(), key=lambda kv: kv[1])[:4]
    return "nearest in the first run: " + ", ".join(f"{k} {v:.3g}" for k, v in nearest)


def test_hybrid_on_smb_node_groups_with_16_bit_sums_trains_like_float32(cluster, name):
    res = spawn_ranks(WORLD, hybrid_worker, cluster.address, cluster.token, free_port(), name, timeout=180)
    f32 = {r: res[r][None] for r in range(WORLD)}
    b16 = {r: res[r]["bf16"] for r in range(WORLD)}
    assert res[0]["backend"] == "smb"
    assert f32[0]["wire"] is None and b16[0]["wire"] == "bf16"
    for a, b in ((0, 1), (2, 3)):      # one replica per node, in both runs, at every step
        for run in (f32, b16):
            for pa, pb in zip(run[a]["after"], run[b]["after"], strict=True):
                assert np.array_equal(pa, pb)
    for r in range(WORLD):
        # before the first elastic update the runs differ only by the 16-bit gradients
        differ = [k for k in b16[r]["stages"] if not np.array_equal(b16[r]["stages"][k], f32[r]["stages"][k])]
        assert np.array_equal(b16[r]["start"], f32[r]["start"]), \
            (f"rank {r}: the second run starts elsewhere; its weights differed after {differ or 'the broadcast'}; "
             f"first elements, runs 1 and 2: {f32[r]['start'][:4]}, {b16[r]['start'][:4]}; "
             f"{_nearest(b16[r]['start'], f32)}")
        moved = np.abs(f32[r]["after"][INTERVAL - 2] - f32[r]["start"]).max()
        apart = [np.abs(b16[r]["after"][s] - f32[r]["after"][s]).max() for s in range(INTERVAL - 1)]
        assert 0 < apart[0] and max(apart) < 0.02 * moved, (apart, moved)
        np.testing.assert_allclose(b16[r]["losses"], f32[r]["losses"], rtol=0.02, atol=0.02)
        assert b16[r]["stop"] == f32[r]["stop"] == (r < NODE_SIZE)   # rank 0 asked: its node agrees
    assert f32[0]["losses"][-1] < f32[0]["losses"][0]     # it did learn
    # every step's seconds by phase, on every worker; the leaders' include SEASGD's waits
    from smb_client.torch.steps import PHASES
    for r in range(WORLD):
        for run in (f32, b16):
            assert run[r]["steps"] == STEPS and set(run[r]["last"]) == set(PHASES)
            assert run[r]["total"]["sum"] > 0 and all(v >= 0 for v in run[r]["total"].values())
    assert {tag for tag, _, _ in b16[0]["scalars"]} == {f"smb/hybrid/{p}_seconds" for p in PHASES}
    assert [s for _, _, s in b16[0]["scalars"]] == [s for s in range(1, STEPS + 1) for _ in PHASES]
    assert {"smb::hybrid.sum", "smb::hybrid.barrier", "smb::seasgd.sum"} <= set(b16[0]["ranges"])


def test_hybrid_compression_is_refused_where_it_cannot_apply(cluster, name, monkeypatch):
    """An unknown name, a gloo node group (the memory box does not carry its sum) and
    parameters that are not float32 are refused before any exchange."""
    import torch.distributed as dist

    from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, ParameterStore, new_node_groups
    from smb_protocol.errors import DtypeError, InvalidArgument
    monkeypatch.setenv("SMB_CONTROLLER", cluster.address)
    monkeypatch.setenv("SMB_TOKEN", cluster.token)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranks, gloo = new_node_groups(1, 1)
        _, smb = new_node_groups(1, 1, backend="smb")
        flat = FlatModel(torch.nn.Linear(3, 2))
        with cluster.client() as c:
            store = ParameterStore.create(c, name, flat, scheme="hybrid", workers=1)
            try:
                with SEASGD(store, 0, 1) as seasgd:      # the node's leader: this one worker
                    with pytest.raises(InvalidArgument, match="unknown compression 'int8'"):
                        HybridSEASGD(flat, smb[0], ranks[0], seasgd=seasgd, compression="int8")
                    with pytest.raises(InvalidArgument, match="needs the node groups on the smb backend.*'gloo'"):
                        HybridSEASGD(flat, gloo[0], ranks[0], seasgd=seasgd, compression="bf16")
                    half = FlatModel(torch.nn.Linear(3, 2).half())
                    with pytest.raises(DtypeError, match="float16 chunks cannot travel as bfloat16"):
                        HybridSEASGD(half, smb[0], ranks[0], seasgd=seasgd, compression="bf16")
                    hy = HybridSEASGD(flat, smb[0], ranks[0], seasgd=seasgd, compression="fp16-full")
                    assert (hy.wire, hy.full_sum) == ("fp16", True)
                    hy.close()
            finally:
                store.destroy()
    finally:
        dist.destroy_process_group()
