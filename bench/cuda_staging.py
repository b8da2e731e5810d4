"""CUDA tensors through the memory box: staging throughput and a small training run.

    python bench/cuda_staging.py                          # sizes 64 MB..1 GB, training
    python bench/cuda_staging.py --sizes 64,256 --train-steps 0

Needs a CUDA device. A local cluster (controller + two memory servers on this host) and:

* for each size: ``Region.write`` of a CUDA tensor (staged through pinned buffers,
  :mod:`smb_client.cuda`) against ``t.cpu()`` then write, and ``Region.read_into`` of a
  CUDA tensor against a read into host memory then ``.copy_()`` to the device; as
  references, the same write/read from host memory, and the device's own D2H/H2D rate
  into pinned memory and of ``.cpu()``;
* training (``--train-steps``): two worker processes on the one GPU, an MLP, under
  DDP on the ``smb`` backend, under DDP on gloo (CUDA tensors), under DDP on ``smb``
  with a hook that moves each bucket with ``.cpu()`` (the CPU-tensor path), and under
  :class:`~smb_client.torch.SyncDataParallel`: steps/s, gradient bytes moved, and
  whether the final weights are equal bit for bit.

Throughput in MB/s (1e6 bytes), best of ``--repeats``. Prints tables; writes JSON to
``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

WORLD = 2
BATCH = 64
WIDTH = 1024
LR = 0.01


def _best(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(region, nbytes, repeats):
    """Seconds of each way of moving ``nbytes`` (best of ``repeats``)."""
    dev = torch.randn(nbytes // 4, device="cuda")
    pinned = torch.empty(nbytes // 4, pin_memory=True)
    host = torch.empty(nbytes // 4)
    sync = torch.cuda.synchronize
    region.write(0, dev)            # warm the pools and the connections
    region.read_into(0, dev)
    sync()

    def pull_staged():
        region.read_into(0, dev)
        sync()

    def pull_cpu():
        region.read_into(0, host)
        dev.copy_(host)
        sync()
    t = {
        "d2h_pinned": _best(lambda: (pinned.copy_(dev), sync()), repeats),
        "h2d_pinned": _best(lambda: (dev.copy_(pinned), sync()), repeats),
        "d2h_cpu()": _best(lambda: dev.cpu(), repeats),
        "push_staged": _best(lambda: region.write(0, dev), repeats),
        "push_cpu()": _best(lambda: region.write(0, dev.cpu()), repeats),
        "push_host": _best(lambda: region.write(0, pinned), repeats),
        "pull_staged": _best(pull_staged, repeats),
        "pull_cpu()": _best(pull_cpu, repeats),
        "pull_host": _best(lambda: region.read_into(0, host), repeats),
    }
    check = torch.empty_like(dev)
    region.write(0, dev)
    region.read_into(0, check)
    return t, bool(torch.equal(check, dev))


def staging(cluster, sizes_mb, repeats):
    client = cluster.client()
    rows = []
    for mb in sizes_mb:
        nbytes = mb * 1_000_000 // 4 * 4
        region = client.create_region(f"bench/cuda{mb}", nbytes)
        try:
            t, equal = _measure(region, nbytes, repeats)
            row = {"MB": mb, "bytes": nbytes, "equal": equal,
                   "transport": sorted(set(region.transports().values()))}
            row.update({k: round(nbytes / v / 1e6) for k, v in t.items()})
            rows.append(row)
            print(row, flush=True)
        finally:
            client.delete_region(f"bench/cuda{mb}")
    client.close()
    return rows


# -- training ------------------------------------------------------------------------
def make_model():
    torch.manual_seed(7)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _cpu_hook(world):
    import torch.distributed as dist

    def hook(state, bucket):
        buf = bucket.buffer()
        host = buf.cpu()          # the CPU-tensor path: the whole bucket to the host and back
        host.div_(world)
        dist.all_reduce(host)
        buf.copy_(host)
        fut = torch.futures.Future(devices=[buf.device])
        fut.set_result(buf)
        return fut
    return hook


def train_worker(rank, queue, mode, steps, init, address, token, prefix):
    try:
        os.environ.update(SMB_CONTROLLER=address, SMB_TOKEN=token)
        import torch.distributed as dist

        import smb_client
        import smb_client.torch as smbt
        torch.cuda.set_device(0)
        model = make_model().cuda()
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if mode.startswith("ddp"):
            dist.init_process_group("gloo" if mode == "ddp-gloo" else "smb", init_method=init, rank=rank,
                                    world_size=WORLD, timeout=datetime.timedelta(seconds=120))
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=8)
            if mode == "ddp-smb-cpu":
                net.register_comm_hook(None, _cpu_hook(WORLD))
            dp = client = store = None
        else:
            client = smb_client.connect(address, token)
            env = smbt.WorkerEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
            store = smbt.open_store(client, env, prefix, model, workers=WORLD)
            dp = smbt.SyncDataParallel(store, rank, WORLD, buffers="none", check_env=False)
            net = model
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        data = [batch(s, rank) for s in range(steps + 2)]
        data = [(x.cuda(), y.cuda()) for x, y in data]
        t0 = 0.0
        for step in range(steps + 2):
            if step == 2:                   # two warm-up steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            x, y = data[step]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            if dp is not None:
                dp.synchronize()
            opt.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        out = {"steps_per_s": steps / elapsed, "grad_bytes_per_step": grad_bytes, "digest": _digest(model)}
        if dp is not None:
            dp.close(publish=False)
            client.barrier(f"{prefix}/end", WORLD, timeout=60)
            out["store_traffic"] = store.traffic.as_dict()
            if rank == 0:
                store.destroy()
            else:
                store.close()
            client.close()
        else:
            dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training(cluster, steps, modes):
    rows = []
    ctx = mp.get_context("spawn")
    for mode in modes:
        queue = ctx.Queue()
        init = f"tcp://127.0.0.1:{_port()}"
        procs = [ctx.Process(target=train_worker, args=(r, queue, mode, steps, init, cluster.address, cluster.token,
                                                        f"bench/train-{mode}")) for r in range(WORLD)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(30)
        failed = [v for v in got.values() if isinstance(v, str)]
        if failed:
            print(f"{mode} failed:\n{failed[0]}", flush=True)
            rows.append({"mode": mode, "error": failed[0][-2000:]})
            continue
        r0 = got[0]
        row = {"mode": mode, "steps_per_s": round(min(v["steps_per_s"] for v in got.values()), 2),
               "grad_MB_per_step": round(r0["grad_bytes_per_step"] / 1e6, 2),
               "ranks_equal": got[0]["digest"] == got[1]["digest"], "digest": r0["digest"]}
        if "store_traffic" in r0:
            row["store_traffic_rank0"] = r0["store_traffic"]
        rows.append(row)
        print(row, flush=True)
    digests = {r["mode"]: r.get("digest") for r in rows}
    return {"rows": rows, "ddp_smb_equals_gloo": digests.get("ddp-smb") == digests.get("ddp-gloo"),
            "ddp_smb_equals_cpu_path": digests.get("ddp-smb") == digests.get("ddp-smb-cpu")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="MB (1e6 bytes), comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=20, help="0: no training run")
    ap.add_argument("--modes", default="ddp-smb,ddp-gloo,ddp-smb-cpu,sync-cuda")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/cuda_staging.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_staging.py needs a CUDA device")
    from smb_server.commands.local_cluster import LocalCluster
    sizes = [int(s) for s in args.sizes.split(",") if s]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    with LocalCluster(servers=2, capacity=f"{max(sizes, default=64) + 512}M", log_level="WARNING") as cluster:
        result["staging"] = staging(cluster, sizes, args.repeats)
        if args.train_steps:
            result["training"] = training(cluster, args.train_steps, args.modes.split(","))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    cols = ["MB", "d2h_pinned", "h2d_pinned", "d2h_cpu()", "push_staged", "push_cpu()", "push_host",
            "pull_staged", "pull_cpu()", "pull_host", "equal"]
    print(f"\n{result['device']} (MB/s)\n| " + " | ".join(cols) + " |")
    for r in result["staging"]:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    if "training" in result:
        print(json.dumps(result["training"], indent=1))


if __name__ == "__main__":
    main()
