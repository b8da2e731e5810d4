"""Hybrid training: 2 simulated nodes × 2 workers; gloo all-reduce inside a node on
127.0.0.1, SEASGD across nodes through a real local cluster."""
from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

WORLD, NODE_SIZE = 4, 2
STEPS, INTERVAL, BATCH = 6, 2, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hybrid_worker(address, token, prefix, port, rank, overlap, queue):
    try:
        import torch.distributed as dist

        import smb_client
        from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, WorkerEnv, new_node_groups, open_store
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        ranks, groups = new_node_groups(WORLD, NODE_SIZE)
        node, local = rank // NODE_SIZE, rank % NODE_SIZE
        nodes = WORLD // NODE_SIZE
        torch.manual_seed(rank)   # different starting weights everywhere: the store's win
        model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        flat = FlatModel(model)
        client = store = seasgd = None
        if local == 0:
            client = smb_client.connect(address, token)
            env = WorkerEnv(rank=rank, world_size=WORLD, local_world_size=NODE_SIZE)
            store = open_store(client, env, prefix, flat, members=nodes, creator=node == 0,
                               delta_slots=nodes, workers=nodes)
            seasgd = SEASGD(store, node, nodes, moving_rate=0.4, update_interval=INTERVAL)
        hy = HybridSEASGD(flat, groups[node], ranks[node], seasgd=seasgd, update_interval=INTERVAL,
                          overlap=overlap, bucket_bytes=256)
        hy.broadcast_params()
        out = {"rank": rank, "node": node}
        if store is not None:
            out["global0"] = store.regions["params"].read(0, store.layout.slot_bytes, dtype="float32")
        g = torch.Generator().manual_seed(1000 + rank)   # every worker its own data
        x = torch.randn(STEPS * BATCH, 5, generator=g)
        y = torch.randint(0, 3, (STEPS * BATCH,), generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        delta_sum = torch.zeros_like(flat.flat_params)
        for step in range(STEPS):
            hy.zero_grad()
            torch.nn.functional.cross_entropy(model(x[step * BATCH:(step + 1) * BATCH]),
                                              y[step * BATCH:(step + 1) * BATCH]).backward()
            hy.synchronize()
            opt.step()
            if hy.after_step() and seasgd is not None:
                delta_sum += seasgd.delta
            if step == 0:
                out["after_first"] = flat.flat_params.numpy().copy()
        stop = hy.agree(rank == 1)     # one worker of node 0 asks: both of node 0 agree
        hy.close()
        out.update(params=flat.flat_params.numpy().copy(), delta_sum=delta_sum.numpy(), stop=stop)
        if store is not None:
            seasgd.close()
            client.barrier(f"{prefix}/end", nodes, timeout=60)
            out["global1"] = store.regions["params"].read(0, store.layout.slot_bytes, dtype="float32")
            out["updates"] = seasgd.updates
            client.barrier(f"{prefix}/read", nodes, timeout=60)
            if node == 0:
                store.destroy()
            else:
                store.close()
            client.close()
        dist.barrier()
        dist.destroy_process_group()
        queue.put(out)
    except BaseException as exc:
        queue.put({"rank": rank, "error": repr(exc)})
        raise


def test_hybrid_two_nodes_of_two(cluster, name):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=hybrid_worker, args=(cluster.address, cluster.token, name, port, r, True,
                                                      queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        res = {}
        for _ in procs:
            r = queue.get(timeout=150)
            res[r["rank"]] = r
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in res.values():
        assert "error" not in r, r
    # inside a node: one replica (gradients averaged by all-reduce even before any broadcast)
    for a, b in ((0, 1), (2, 3)):
        assert np.array_equal(res[a]["after_first"], res[b]["after_first"])
        assert np.array_equal(res[a]["params"], res[b]["params"])
    # across nodes: asynchronous, different data, different replicas
    assert not np.allclose(res[0]["params"], res[2]["params"])
    assert res[0]["stop"] and res[1]["stop"] and not res[2]["stop"] and not res[3]["stop"]
    # the memory box holds the start weights plus every delta both leaders pushed
    g0, g1 = res[0]["global0"], res[0]["global1"]
    assert np.array_equal(g0, res[2]["global0"])
    assert res[0]["updates"] == res[2]["updates"] == STEPS // INTERVAL
    expected = g0 + res[0]["delta_sum"] + res[2]["delta_sum"]
    np.testing.assert_allclose(g1, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(g1 - g0).max() > 1e-3


def test_hybrid_follows_the_leaders_update_interval(cluster, name):
    """HybridSEASGD runs the elastic update every SEASGD.update_interval steps; another
    interval given to HybridSEASGD is refused (one node of one worker, in this process)."""
    import torch.distributed as dist

    from smb_client.torch import SEASGD, FlatModel, HybridSEASGD, ParameterStore, new_node_groups
    from smb_protocol.errors import InvalidArgument
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranks, groups = new_node_groups(1, 1)
        model = torch.nn.Linear(3, 2)
        flat = FlatModel(model)
        with cluster.client() as c:
            store = ParameterStore.create(c, name, flat, scheme="hybrid", workers=1)
            try:
                seasgd = SEASGD(store, 0, 1, update_interval=3)
                with pytest.raises(InvalidArgument, match="update_interval=2"):
                    HybridSEASGD(flat, groups[0], ranks[0], seasgd=seasgd, update_interval=2)
                hy = HybridSEASGD(flat, groups[0], ranks[0], seasgd=seasgd)
                assert hy.update_interval == 3
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                updated = []
                for step in range(7):
                    hy.zero_grad()
                    model(torch.randn(4, 3)).sum().backward()
                    hy.synchronize()
                    opt.step()
                    if hy.after_step():
                        updated.append(step + 1)
                assert updated == [3, 6] and seasgd.updates == 2
                hy.close()
                seasgd.close()
                # given and equal: fine
                again = HybridSEASGD(flat, groups[0], ranks[0], seasgd=SEASGD(store, 0, 1, update_interval=3),
                                     update_interval=3)
                assert again.update_interval == 3
                again.close()
                assert again.seasgd is not None
                again.seasgd.close()
            finally:
                store.destroy()
    finally:
        dist.destroy_process_group()
