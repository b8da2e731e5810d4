"""A worker of the cluster experiments, run inside a host's namespace by the testbed.

    python -m bench.cluster.worker SPEC.json OUT.json

``SPEC.json`` names the ``mode`` and its parameters (written by :mod:`.experiments`);
the result is written to ``OUT.json``. Modes:

* ``probe``: the controller's list of memory servers;
* ``bandwidth``: this worker's bytes and seconds writing, then reading, its slice of a
  region striped over ``servers`` memory servers (experiment 1);
* ``sharding``: push gradients (accumulate) and pull parameters (read) per step, for
  each placement (experiment 2);
* ``allreduce``: gradient synchronization through the memory box (accumulate, barrier,
  read) and with ``torch.distributed`` gloo all-reduce (experiment 3);
* ``failure``: operations on two regions while the testbed takes one server's link
  down and up again; coordinated through files in ``signal_dir``;
* ``train``, ``monitor``, ``check``, ``cleanup_store``: the replication experiment's
  (:mod:`.replica_worker`);
* ``training``: synchronous training, memory box against DDP (:mod:`.training_worker`);
* ``elastic_sync``, ``elastic_mover``, ``elastic_check``: the elastic-pool benchmark's
  (``bench/elastic.py``, :mod:`.elastic_worker`);
* ``weights``: a trainer publishing weights to readers, against a gloo broadcast
  (:mod:`.weights_worker`).

Workers of one run meet at controller barriers; times are ``time.perf_counter``
seconds, timestamps ``time.time`` (one clock for all namespaces of the machine).
"""
from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from smb_client import Client
from smb_client.transports import tcp
from smb_protocol import errors
from smb_server.commands.local_cluster import wait_for_json

from . import elastic_worker, replica_worker, signal_files, training_worker, weights_worker

log = logging.getLogger(__name__)

BARRIER_TIMEOUT = 300.0   # seconds
MiB = 1 << 20


def _client(spec: dict[str, Any], **kwargs: Any) -> Client:
    """A client of the testbed's controller; ``spec["client"]`` adds Client options."""
    return Client(spec["controller"], os.environ.get("SMB_TOKEN", ""), **{**spec.get("client", {}), **kwargs})


def _open_shared(c: Client, spec: dict[str, Any], name: str, create: Callable[[], Any]) -> Any:
    """Rank 0 creates region ``name``; everybody has a handle after the barrier."""
    region = create() if spec["rank"] == 0 else None
    c.barrier(f"{name}/created", spec["world"], timeout=BARRIER_TIMEOUT)
    return region if region is not None else c.open_region(name)


def _create_filled(c: Client, name: str, size: int, data: np.ndarray, **opts: Any) -> Any:
    """Create region ``name`` (``opts`` as for :meth:`Client.create_region`) and write
    ``data`` at its start."""
    region = c.create_region(name, size, **opts)
    region.write(0, data)
    return region


def _servers_bytes(region: Any) -> dict[str, int]:
    """Bytes of ``region`` held by each memory server."""
    out: dict[str, int] = {}
    for e in region.extents:
        out[e.server_id] = out.get(e.server_id, 0) + e.length
    return out


# -- modes --------------------------------------------------------------------------
def probe(spec: dict[str, Any]) -> dict[str, Any]:
    with _client(spec) as c:
        return {"servers": [{"server_id": s.server_id, "state": s.state, "grpc_address": s.grpc_address,
                             "endpoints": list(s.endpoints)} for s in c.list_servers()]}


def bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    """Write, then read, ``op_bytes`` at this rank's slice for ``seconds`` each; returns
    the start and the end of every operation (``time.time()``)."""
    rank, world, op = spec["rank"], spec["world"], spec["op_bytes"]
    k, seconds, name = spec["servers"], spec["seconds"], spec["region"]
    data = np.random.default_rng(rank).integers(0, 256, op, dtype=np.uint8)
    out = np.empty_like(data)
    with _client(spec) as c:
        region = _open_shared(c, spec, name, lambda: c.create_region(
            name, world * op, placement="striped", stripe_unit=spec["stripe_unit"], num_servers=k))
        offset = rank * op
        region.write(offset, data)          # warm up: connections, page faults
        region.read_into(offset, out)
        result: dict[str, Any] = {"servers": _servers_bytes(region)}
        for kind in ("write", "read"):
            c.barrier(f"{name}/{kind}", world, timeout=BARRIER_TIMEOUT)
            fn = (lambda: region.write(offset, data)) if kind == "write" else \
                (lambda: region.read_into(offset, out))
            start = time.time()
            done: list[float] = []        # time.time() at the end of each operation
            while True:
                fn()
                done.append(time.time())
                if done[-1] - start >= seconds:
                    break
            result[kind] = {"op_bytes": op, "start": start, "done": done}
        result["verified"] = bool(np.array_equal(out, data))
        c.barrier(f"{name}/done", world, timeout=BARRIER_TIMEOUT)
        region.close()
        if rank == 0:
            c.delete_region(name)
    return result


def sharding(spec: dict[str, Any]) -> dict[str, Any]:
    """Per step: accumulate the gradients, barrier, read the parameters."""
    rank, world, k = spec["rank"], spec["world"], spec["servers"]
    segments: list[int] = spec["segments"]
    slot = sum(segments)
    grads = np.full(slot // 4, rank + 1, dtype=np.float32)
    params = np.empty(slot // 4, dtype=np.float32)
    initial = np.arange(slot // 4, dtype=np.float32)
    steps = spec["warmup"] + spec["steps"]
    result: dict[str, Any] = {}
    with _client(spec) as c:
        for placement in spec["placements"]:
            base = f"{spec['tag']}/{placement}"
            opts: dict[str, Any] = {"placement": placement, "num_servers": k}
            if placement == "layered":
                opts["segment_sizes"] = segments
            else:
                opts["stripe_unit"] = spec["stripe_unit"]
            p_region = _open_shared(c, spec, f"{base}/params",
                                    functools.partial(_create_filled, c, f"{base}/params", slot, initial, **opts))
            g_region = _open_shared(c, spec, f"{base}/grads",
                                    functools.partial(c.create_region, f"{base}/grads", slot, **opts))
            times: list[dict[str, float]] = []
            window = [0.0, 0.0]       # time.time() of the measured steps
            for s in range(steps):
                if s == spec["warmup"]:
                    window[0] = time.time()
                c.barrier(f"{base}/step{s}", world, timeout=BARRIER_TIMEOUT)
                t0 = time.perf_counter()
                g_region.accumulate(0, grads)
                t1 = time.perf_counter()
                c.barrier(f"{base}/pushed{s}", world, timeout=BARRIER_TIMEOUT)
                t2 = time.perf_counter()
                p_region.read_into(0, params)
                t3 = time.perf_counter()
                if s >= spec["warmup"]:
                    times.append({"push": t1 - t0, "barrier": t2 - t1, "pull": t3 - t2, "step": t3 - t0})
            window[1] = time.time()
            c.barrier(f"{base}/done", world, timeout=BARRIER_TIMEOUT)
            verified = bool(np.array_equal(params, initial))
            if rank == 0:
                total = g_region.read(0, slot, dtype="float32")
                verified = verified and bool(np.all(total == steps * world * (world + 1) / 2))
            result[placement] = {"times": times, "verified": verified, "window": window,
                                 "servers": _servers_bytes(p_region)}
            c.barrier(f"{base}/checked", world, timeout=BARRIER_TIMEOUT)
            p_region.close()
            g_region.close()
            if rank == 0:
                c.delete_region(f"{base}/params")
                c.delete_region(f"{base}/grads")
    return result


def _smb_allreduce(c: Client, spec: dict[str, Any], size: int) -> dict[str, Any]:
    """Sum ``size`` bytes of float32 over the workers through the memory box.

    Three slots used in turn (as in :mod:`smb_client.torch.sync`): sync ``s``
    accumulates into slot ``s % 3`` while every worker zeroes its share of slot
    ``(s+1) % 3`` server-side (``scale`` by 0), meets the others at a barrier, then
    reads the sum.
    """
    rank, world = spec["rank"], spec["world"]
    n = size // 4
    grads = np.full(n, rank + 1, dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    name = f"{spec['tag']}/smb{size}"
    region = _open_shared(c, spec, name, lambda: c.create_region(
        name, 3 * size, placement="striped", stripe_unit=spec["stripe_unit"], num_servers=spec["servers"]))
    share = -(-n // world) * 4
    lo, hi = min(size, rank * share), min(size, (rank + 1) * share)
    times, ok, window = [], True, [0.0, 0.0]
    phases: list[dict[str, float]] = []   # seconds per phase of each measured sync
    for s in range(spec["warmup"] + spec["syncs"]):
        if s == spec["warmup"]:
            window[0] = time.time()
        c.barrier(f"{name}/align{s}", world, timeout=BARRIER_TIMEOUT)
        t0 = time.perf_counter()
        zero = region.scale_async(((s + 1) % 3) * size + lo, hi - lo, 0.0, "float32") if hi > lo else None
        region.accumulate((s % 3) * size, grads)
        if zero is not None:
            zero.result()
        ta = time.perf_counter()
        c.barrier(f"{name}/sum{s}", world, timeout=BARRIER_TIMEOUT)
        tb = time.perf_counter()
        region.read_into((s % 3) * size, out)
        t1 = time.perf_counter()
        ok = ok and bool(np.all(out == world * (world + 1) / 2))
        if s >= spec["warmup"]:
            times.append(t1 - t0)
            phases.append({"accumulate": ta - t0, "barrier": tb - ta, "read": t1 - tb})
    window[1] = time.time()
    c.barrier(f"{name}/done", world, timeout=BARRIER_TIMEOUT)
    transports = sorted(set(region.transports().values()))
    region.close()
    if rank == 0:
        c.delete_region(name)
    return {"times": times, "phases": phases, "verified": ok, "transports": transports, "window": window}


def _smb_collective(c: Client, spec: dict[str, Any], size: int, weighted: bool = False,
                    pipelined: bool = True, wire: str | None = None) -> dict[str, Any]:
    """Sum ``size`` bytes of float32 over the workers with :class:`Collective`
    (chunks dealt over the servers; no barrier, no controller call): streamed sums
    (``REDUCE`` on one pipelined connection per server, default chunks and window) or,
    without ``pipelined``, as before them: a push and a pull per chunk on pooled
    connections, 8 of each in flight, chunks of up to 4 MiB (``pushpull``).
    ``weighted``: chunks shared by spare link capacity, from every worker's host
    (``spec["worker_hosts"]``), not evenly. ``wire``: the chunks travel as that 16-bit
    type and are summed in float32 (``Collective.all_reduce(..., wire=)``)."""
    from smb_client.collective import Collective
    rank, world = spec["rank"], spec["world"]
    n = size // 4
    grads = np.empty(n, dtype=np.float32)
    name = f"{spec['tag']}/coll{'w' if weighted else ''}{'' if pipelined else 'p'}{wire or ''}{size}"
    chunk = None if pipelined else max(64 << 10, min(4 << 20, -(-size // (spec["servers"] * 4 * 4096)) * 4096))
    if rank == 0 and weighted:
        coll = Collective.create(c, name, size, world, worker_hosts=spec["worker_hosts"], timeout=BARRIER_TIMEOUT)
    elif rank == 0:
        coll = Collective.create(c, name, size, world, num_servers=spec["servers"], timeout=BARRIER_TIMEOUT,
                                 chunk_bytes=chunk, pipelined=pipelined)
    c.barrier(f"{name}/created", world, timeout=BARRIER_TIMEOUT)
    if rank != 0:
        coll = Collective.open(c, name, world, timeout=BARRIER_TIMEOUT, pipelined=pipelined)

    def align(s: int) -> None:
        grads.fill(rank + 1)
        c.barrier(f"{name}/align{s}", world, timeout=BARRIER_TIMEOUT)
    timed = _time_syncs(spec, align, lambda: coll.all_reduce(grads, wire=wire),
                        lambda: bool(np.all(grads == world * (world + 1) / 2)))
    c.barrier(f"{name}/done", world, timeout=BARRIER_TIMEOUT)
    servers = sorted({chunk.place.server_id for chunk in coll.chunks})
    per_server = {sid: sum(chunk.length for chunk in coll.chunks if chunk.place.server_id == sid)
                  for sid in servers}
    if rank == 0:
        coll.destroy()
    else:
        coll.close()
    return {**timed, "servers": len(servers), "bytes_per_server": per_server, "chunk_bytes": coll.chunks[0].length}


def _gloo_allreduce(spec: dict[str, Any], size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    rank, world = spec["rank"], spec["world"]
    t = torch.empty(size // 4, dtype=torch.float32)

    def align(s: int) -> None:
        t.fill_(rank + 1)
        dist.barrier()
    return _time_syncs(spec, align, lambda: dist.all_reduce(t), lambda: bool(torch.all(t == world * (world + 1) / 2)))


def _time_syncs(spec: dict[str, Any], align: Callable[[int], None], sync: Callable[[], object],
                right: Callable[[], bool]) -> dict[str, Any]:
    """``spec["warmup"]`` syncs, then ``spec["syncs"]`` measured ones: ``align(s)``
    (fill the gradient, meet the others) untimed, ``sync()`` timed, ``right()`` (the sum
    is right) after each. The measured syncs' seconds and their ``time.time()`` spans,
    whether every sum was right, and the window they ran in."""
    times, ok, window = [], True, [0.0, 0.0]
    spans: list[list[float]] = []
    for s in range(spec["warmup"] + spec["syncs"]):
        if s == spec["warmup"]:
            window[0] = time.time()
        align(s)
        w0, t0 = time.time(), time.perf_counter()
        sync()
        t1 = time.perf_counter()
        ok = ok and right()
        if s >= spec["warmup"]:
            times.append(t1 - t0)
            spans.append([w0, w0 + t1 - t0])
    window[1] = time.time()
    return {"times": times, "verified": ok, "window": window, "spans": spans}


def allreduce(spec: dict[str, Any]) -> dict[str, Any]:
    """For each size: the memory box, then gloo, on the same hosts."""
    import torch.distributed as dist
    training_worker.init_gloo(spec)
    result: dict[str, Any] = {}
    try:
        with _client(spec) as c:
            for size in spec["sizes"]:
                result[str(size)] = {"smb": _smb_allreduce(c, spec, size),
                                     "collective": _smb_collective(c, spec, size),
                                     "pushpull": _smb_collective(c, spec, size, pipelined=False),
                                     "bf16": _smb_collective(c, spec, size, wire="bf16"),
                                     "gloo": _gloo_allreduce(spec, size)}
                if spec.get("worker_hosts"):
                    result[str(size)]["weighted"] = _smb_collective(c, spec, size, weighted=True)
    finally:
        dist.destroy_process_group()
    return result


# -- failure ------------------------------------------------------------------------
def _wait_file(path: Path, timeout: float) -> dict[str, Any]:
    try:
        return wait_for_json(path, timeout, poll=0.02)
    except TimeoutError:
        raise errors.Timeout(f"{path.name} did not appear within {timeout:.0f} s") from None


def _server_state(c: Client, server_id: str) -> str:
    return next((s.state for s in c.list_servers() if s.server_id == server_id), "missing")


def _until(fn: Callable[[], bool], timeout: float, pause: float = 0.1) -> float | None:
    """Poll ``fn`` until true; the time.time() it was, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if fn():
                return time.time()
        except errors.SMBError as exc:
            log.debug("poll: %s", exc)
        time.sleep(pause)
    return None


def failure(spec: dict[str, Any]) -> dict[str, Any]:
    """Region ``a`` and ``b`` on different servers; read ``a`` until its server's link
    goes down, check ``b``, then wait for the link and for ``a`` to come back."""
    sig = Path(spec["signal_dir"])
    io_timeout, lease = spec["io_timeout"], spec["lease_seconds"]
    size = spec["size"]
    pattern = {n: np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i, n in enumerate("ab")}
    out = np.empty(size, dtype=np.uint8)
    result: dict[str, Any] = {"io_timeout": io_timeout, "lease_seconds": lease,
                              "dead_peer_timeout": tcp.DEAD_PEER_TIMEOUT}
    options = {} if io_timeout is None else {"io_timeout": io_timeout}
    with _client(spec, transport_options=options, connections=1) as c:
        ra = c.create_region(f"{spec['tag']}/a", size, placement="single")
        rb = c.create_region(f"{spec['tag']}/b", size, placement="single")
        sa, sb = ra.extents[0].server_id, rb.extents[0].server_id
        if sa == sb:
            raise RuntimeError(f"both regions landed on server {sa}")
        ra.write(0, pattern["a"])
        rb.write(0, pattern["b"])
        signal_files.write(sig / "ready.json", {"a": sa, "b": sb})
        down = None
        reads_before = 0
        deadline = time.monotonic() + spec["max_wait"]
        while time.monotonic() < deadline:            # read a until it fails
            if down is None and (sig / "down.json").exists():
                down = _wait_file(sig / "down.json", 1.0)["time"]
            t0 = time.time()
            try:
                ra.read_into(0, out)
            except errors.SMBError as exc:
                t1 = time.time()
                result["error"] = {"type": type(exc).__name__, "message": str(exc),
                                   "unavailable_or_timeout": isinstance(exc, (errors.Unavailable, errors.Timeout)),
                                   "op_seconds": t1 - t0, "at": t1}
                break
            if not np.array_equal(out, pattern["a"]):
                raise RuntimeError("region a read back wrong data before the failure")
            reads_before += 1
            time.sleep(0.01)
        result["reads_before"] = reads_before
        if down is None and (sig / "down.json").exists():
            down = _wait_file(sig / "down.json", 1.0)["time"]
        result["down_at"] = down
        if "error" in result and down is not None:
            result["error"]["after_down_seconds"] = result["error"]["at"] - down
        # a further operation needs a new connection: bounded by the io timeout as well
        t0 = time.time()
        try:
            ra.read_into(0, out)
            result["retry_error"] = None
        except errors.SMBError as exc:
            result["retry_error"] = {"type": type(exc).__name__, "message": str(exc),
                                     "op_seconds": time.time() - t0}
        # the other server keeps serving
        b_ok, t0 = True, time.perf_counter()
        for _ in range(spec["b_ops"]):
            rb.write(0, pattern["b"])
            rb.read_into(0, out)
            b_ok = b_ok and bool(np.array_equal(out, pattern["b"]))
        result["other_region"] = {"ok": b_ok, "ops": spec["b_ops"], "seconds": time.perf_counter() - t0}
        marked = _until(lambda: _server_state(c, sa) == "down", 3 * lease)
        result["marked_down_after_seconds"] = None if marked is None or down is None else marked - down
        signal_files.write(sig / "error.json", {"time": time.time()})
        up = _wait_file(sig / "up.json", spec["max_wait"])["time"]
        result["up_at"] = up
        rejoined = _until(lambda: _server_state(c, sa) == "up", spec["rejoin_timeout"])
        result["rejoined_after_seconds"] = None if rejoined is None else rejoined - up

        def read_a() -> bool:
            ra.read_into(0, out)
            return True
        recovered = _until(read_a, spec["rejoin_timeout"], pause=0.2)
        result["recovered_after_seconds"] = None if recovered is None else recovered - up
        result["data_intact"] = recovered is not None and bool(np.array_equal(out, pattern["a"]))
        states = {r.name: r.state for r in c.list_regions(spec["tag"])}
        result["region_states"] = states
        ra.close()
        rb.close()
        for r in (f"{spec['tag']}/a", f"{spec['tag']}/b"):
            try:
                c.delete_region(r)
            except errors.SMBError as exc:
                log.warning("delete %s: %s", r, exc)
    return result


MODES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "probe": probe, "bandwidth": bandwidth, "sharding": sharding, "allreduce": allreduce,
    "failure": failure, **replica_worker.MODES, **training_worker.MODES, **elastic_worker.MODES,
    **weights_worker.MODES,
}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m bench.cluster.worker SPEC.json OUT.json\n")
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(level=spec.get("log_level", "WARNING"),
                        format=f"%(asctime)s {spec.get('host', '?')} %(levelname)s %(name)s: %(message)s")
    # the testbed sends SIGUSR1 to a worker that overran its time: every thread's stack
    # goes to the log, which the error quotes (Testbed.watch_workers)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    result = MODES[spec["mode"]](spec)
    tmp = Path(argv[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
