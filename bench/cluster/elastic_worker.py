"""The worker modes of the elastic-pool benchmark (``bench/elastic.py``), run by
:mod:`.worker` inside a host's namespace:

* ``elastic_sync``: one worker of synchronous training (:class:`SyncDataParallel`, the
  digits model and data of :mod:`smb_train.workers`, as ``smb train --scheme sync``
  trains them) that records every step (its end, ``time.time()``; its seconds; the
  time it waited for the exchange), keeps the parameter store at the end and saves its
  final weights (the store's byte layout) for the check; SEASGD runs the digits
  trainer itself (:func:`.replica_worker.train`);
* ``elastic_mover``: on the controller's host, with the admin credential: samples the
  workers' shared step counters, the memory servers (bytes, extents, bytes moved) and
  the regions' states every ``poll`` seconds; after the workers' first step (every
  region of the job exists) asks for the spare memory server (``join.json``; the
  benchmark starts it and answers ``joined.json``); once the workers are ``fraction``
  of the way through, evacuates the server holding the most bytes of the job (``smb
  server drain --evacuate``, then ``smb server remove``; ``removed.json`` tells the
  benchmark to stop its daemon) or rebalances (``smb rebalance``);
* ``elastic_check``: after the workers finished, on the controller's host: every copy
  of every slot of the store read on its own server and compared byte for byte; for
  synchronous training the stored weights against every worker's final weights, byte
  for byte; for SEASGD the global weights against the initial weights plus every delta
  pushed, and the counters against the workers' step counts; then the store is deleted.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from smb_client import Client
from smb_protocol import errors
from smb_protocol.placement import ExtentPlace
from smb_server.testing import copies

from . import replica_worker, signal_files

log = logging.getLogger(__name__)

BARRIER_TIMEOUT = 300.0    # seconds
FILE_WAIT = 120.0          # seconds the mover waits for the spare server to join
AFTER_STEPS = 50           # steps a synchronous run trains at least after the move ended


def _client(spec: dict[str, Any], token: str | None = None) -> Client:
    return Client(spec["controller"], token if token is not None else os.environ.get("SMB_TOKEN", ""))


# -- synchronous training ---------------------------------------------------------------
def train_sync(spec: dict[str, Any]) -> dict[str, Any]:
    """One SyncDataParallel worker of the digits model (see the module docstring)."""
    import torch

    from smb_client.torch import FlatModel, SharedCounters, SyncDataParallel, WorkerEnv, open_store
    from smb_train.workers import _epoch_batches, accuracy, load_data, make_model, train_step
    torch.set_num_threads(1)
    rank, world, b = spec["rank"], spec["world"], spec["batch"]
    data = load_data(spec["data"])
    t = {k: torch.from_numpy(v) for k, v in data.items()}
    env = WorkerEnv(rank=rank, world_size=world, local_rank=0, local_world_size=1)
    prefix = spec["prefix"]
    replicas = {"replicas": spec["replicas"]} if spec.get("replicas", 1) > 1 else {}
    with _client(spec) as client:
        model = make_model(spec["seed"], spec["hidden"])
        store = open_store(client, env, prefix, model, placement="striped", scheme="sync", workers=world,
                           **replicas)
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
        total_steps = len(t["y_train"]) // (world * b) * spec["epochs"]
        # no rule fires: rank 0 asks everyone to stop (_done), in lockstep, once the run has
        # its steps and the move, if any, is over with steps after it
        counters = SharedCounters(store.region("counters"), rank, world, "master", 0, lockstep=True)
        dp = SyncDataParallel(store, rank, world, overlap=True, counters=counters)
        done = _Done(spec, total_steps)
        # [time.time() at its end, seconds, seconds waiting for the exchange, loss] per step
        steps: list[tuple[float, float, float, float]] = []
        client.barrier(f"{prefix}/start", world, timeout=BARRIER_TIMEOUT)
        start_time = time.time()
        epoch = 0
        while not dp.stop:
            for batch in _epoch_batches(torch, len(t["y_train"]), world * b, spec["seed"], epoch):
                s0, w0 = time.perf_counter(), dp.comm_wait
                idx = batch[rank * b:(rank + 1) * b]
                loss = train_step(model, opt, t["x_train"][idx], t["y_train"][idx], dp)
                steps.append((time.time(), time.perf_counter() - s0, dp.comm_wait - w0, loss.item()))
                if rank == 0 and done(len(steps)):
                    counters.request_stop()
                if dp.stop:
                    break
            epoch += 1
        dp.close()                 # publishes the final weights into the store
        counters.finish()
        client.barrier(f"{prefix}/end", world, timeout=BARRIER_TIMEOUT)
        weights = FlatModel(model).param_bytes.detach().numpy().copy()
        np.save(Path(spec["result_dir"]) / f"sync-rank{rank}-weights.npy", weights)
        result = {"rank": rank, "start_time": start_time, "steps": len(steps), "comm_wait": dp.comm_wait,
                  "accuracy": accuracy(model, t["x_test"], t["y_test"]), "step_log": steps,
                  "weight_bytes": int(weights.size)}
        store.close()              # the check reads it, then deletes it
    return result


class _Done:
    """Whether a synchronous run has trained enough (rank 0 asks, after every step): its
    ``total_steps``, and where the mover moves data, also :data:`AFTER_STEPS` steps after
    the move ended (``moved.json``), so that the run's steps before, during and after the
    move are measured however fast training is; or once the mover gave up
    (``mover_done.json``)."""

    def __init__(self, spec: dict[str, Any], total_steps: int) -> None:
        self.total_steps = total_steps
        self.waits = spec.get("action", "none") != "none"
        self.sig = Path(spec["signal_dir"]) if self.waits else None
        self.moved_at: int | None = None

    def __call__(self, steps: int) -> bool:
        if steps < self.total_steps:
            return False
        if self.sig is None or (self.sig / "mover_done.json").exists():
            return True
        if self.moved_at is None and (self.sig / "moved.json").exists():
            self.moved_at = steps
        return self.moved_at is not None and steps >= self.moved_at + AFTER_STEPS


# -- mover ------------------------------------------------------------------------------
def store_bytes(c: Client, prefix: str, *, primaries: bool = False) -> dict[str, dict[str, int]]:
    """Bytes of every copy of the store's regions, per region and memory server; with
    ``primaries``, of the primaries alone (the copies that serve reads and order
    mutations; the only copy of an unreplicated slot)."""
    out: dict[str, dict[str, int]] = {}
    for r in c.list_regions(f"{prefix}/"):
        info, _ = c.open_info(r.name, "ro")
        per: dict[str, int] = {}
        for e in (*info.extents, *(() if primaries else getattr(info, "copies", ()))):
            p = ExtentPlace.from_message(e)
            per[p.server_id] = per.get(p.server_id, 0) + p.length
        out[r.name.rpartition("/")[2]] = per
    return out


def store_heads(c: Client, prefix: str) -> dict[str, dict[str, int]]:
    """How many slots of each of the store's regions each memory server heads (holds
    the primary of, or the only copy of an unreplicated slot)."""
    out: dict[str, dict[str, int]] = {}
    for r in c.list_regions(f"{prefix}/"):
        info, _ = c.open_info(r.name, "ro")
        per: dict[str, int] = {}
        for e in info.extents:
            p = ExtentPlace.from_message(e)
            per[p.server_id] = per.get(p.server_id, 0) + 1
        out[r.name.rpartition("/")[2]] = per
    return out


def _servers(admin: Client) -> dict[str, list[Any]]:
    """server id -> [state, bytes used, extents, bytes moved off it, its move rate (bytes/s)]."""
    return {s.server_id: [s.state, s.used, s.extents, s.moved_bytes, s.move_rate] for s in admin.list_servers()}


def mover(spec: dict[str, Any]) -> dict[str, Any]:
    """See the module docstring; ``spec["action"]``: ``evacuate``, ``rebalance`` or ``none``."""
    from smb_server.commands.tokens import admin_token
    sig = Path(spec["signal_dir"])
    prefix, world, action = spec["prefix"], spec["world"], spec["action"]
    trigger = int(spec["fraction"] * spec["target_total"])
    poll, rate = spec.get("poll", 0.1), float(spec.get("rate", 0.0))
    deadline = time.monotonic() + spec["timeout"]
    out: dict[str, Any] = {"action": action, "trigger_total": trigger, "progress": [], "servers": [],
                           "states": [], "not_ready_seen": [], "errors": []}
    with _client(spec) as c, _client(spec, admin_token(spec["secret_file"])) as admin:
        replica_worker.wait_for_store(c, spec, deadline, ("counters", "meta"))
        counters = c.open_region(f"{prefix}/counters")
        phase = "start" if action != "none" else "none"
        source = ""
        base_moved = 0
        while time.monotonic() < deadline:
            now = time.time()
            try:
                total, finished = replica_worker.progress(counters, world)
                out["progress"].append([now, total])
                servers = _servers(admin)
                states = replica_worker.region_states(c, prefix)
            except errors.SMBError as exc:   # reported; the run's check decides
                out["errors"].append([now, f"{type(exc).__name__}: {exc}"])
                time.sleep(poll)
                continue
            replica_worker.record_change(out["servers"], now, servers)
            replica_worker.record_change(out["states"], now, states)
            bad = {k: v for k, v in states.items() if v != "ready"}
            if bad:
                out["not_ready_seen"].append([now, bad])
            if phase == "start" and total >= 1:   # every region of the job exists: the spare joins
                out["join_asked"] = now
                signal_files.write(sig / "join.json", {"time": now})
                phase = "joining"
            elif phase == "joining" and (joined := signal_files.read(sig / "joined.json")) is not None:
                out["joined"] = joined
                phase = "before"
            elif phase == "before" and total >= trigger:
                out["trigger"] = {"time": now, "total": total}
                out["store_before"] = store_bytes(c, prefix)
                out["heads_before"] = store_bytes(c, prefix, primaries=True)
                out["head_slots_before"] = store_heads(c, prefix)
                out["servers_before"] = _servers(admin)
                held = {s: sum(per.get(s, 0) for per in out["store_before"].values())
                        for s in out["servers_before"]}
                out["job_bytes_before"] = held
                if action == "evacuate":   # the server holding the most of the job's bytes
                    source = max((s for s, v in out["servers_before"].items() if v[0] == "up"),
                                 key=lambda s: (held[s], out["servers_before"][s][1]))
                    out["source"] = {"server": source, "bytes_used": out["servers_before"][source][1],
                                     "extents": out["servers_before"][source][2], "job_bytes": held[source]}
                    out["move_start"] = time.time()
                    admin.drain_server(source, evacuate=True)
                else:
                    out["move_start"] = time.time()
                    r = admin.rebalance(rate)
                    base_moved = r.bytes_moved
                    out["rebalance_first"] = {"running": r.running, "bytes_left": r.bytes_left}
                out["moved"] = []   # [time, bytes moved so far]
                phase = "moving"
            elif phase == "moving":
                if action == "evacuate":
                    s = servers.get(source)
                    moved, done = (s[3], s[2] == 0) if s else (0, False)
                else:
                    r = admin.rebalance(rate)
                    moved, done = r.bytes_moved - base_moved, not r.running
                out["moved"].append([now, moved])
                if done:
                    out["move_end"] = now
                    signal_files.write(sig / "moved.json", {"time": now})   # the workers may stop
                    out["bytes_moved"] = moved
                    out["servers_after_move"] = servers
                    out["heads_after"] = store_bytes(c, prefix, primaries=True)
                    out["head_slots_after"] = store_heads(c, prefix)
                    if action == "evacuate":
                        out["removed"] = admin.remove_server(source).server_id
                        signal_files.write(sig / "removed.json", {"time": time.time(), "server": source})
                    phase = "after"
            if (sig / "stop.json").exists():
                out["stopped"] = True
                break
            if finished >= world and phase in ("none", "after"):
                break
            time.sleep(poll)
        else:
            out["timed_out"] = True
        signal_files.write(sig / "mover_done.json", {"time": time.time()})
        out["phase"] = phase
        out["servers_end"] = _servers(admin)
        try:
            out["store_after"] = store_bytes(c, prefix)
        except errors.SMBError as exc:
            out["errors"].append([time.time(), f"{type(exc).__name__}: {exc}"])
        counters.close()
    return out


# -- check ------------------------------------------------------------------------------
def check(spec: dict[str, Any]) -> dict[str, Any]:
    """See the module docstring; deletes the store at the end."""
    prefix, world = spec["prefix"], spec["world"]
    result: dict[str, Any] = {}
    with _client(spec) as c:
        regions = c.list_regions(f"{prefix}/")
        result["states"] = {r.name.rpartition("/")[2]: r.state for r in regions}
        result["copies"] = {r.name.rpartition("/")[2]: copies.compare_copies(c, r.name) for r in regions}
        try:
            if spec["scheme"] == "sync":
                result["weights"] = _sync_weights(c, spec)
            else:
                result.update(replica_worker._weights_and_counters(c, spec))
        except errors.SMBError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["deleted"] = len(c.delete_regions(f"{prefix}/"))
    for compared in result["copies"].values():
        compared.pop("slots", None)   # per-slot detail: only the totals are kept
    result["world"] = world
    return result


def _sync_weights(c: Client, spec: dict[str, Any]) -> dict[str, Any]:
    """The store's ``params`` region against every worker's final weights, byte for byte."""
    mine = [np.load(Path(spec["result_dir"]) / f"sync-rank{r}-weights.npy") for r in range(spec["world"])]
    params = c.open_region(f"{spec['prefix']}/params")
    stored = np.frombuffer(bytes(params.read(0, mine[0].size)), dtype=np.uint8)
    params.close()
    return {"bytes": int(stored.size),
            "differing_bytes_store_vs_workers": [int(np.count_nonzero(stored != w)) for w in mine],
            "differing_bytes_between_workers": int(max(np.count_nonzero(w != mine[0]) for w in mine))}


MODES = {"elastic_sync": train_sync, "elastic_mover": mover, "elastic_check": check}
