"""The worker modes of the replication experiment (see :mod:`.replication`), run by
:mod:`.worker` inside a host's namespace:

* ``train``: one SEASGD worker of the digits trainer (:mod:`smb_train.workers`,
  the code ``smb train`` runs), its rank and world given as torchrun would;
* ``monitor``: on the controller's host, watches the training's parameter store: where
  its copies are (``placement.json``), the regions' and servers' states, the shared
  iteration counters; asks for the kill (``kill.json``) once the workers are a given
  fraction through, and after the kill (``killed.json``) times one mutation at the
  killed primary's slot (the first that completes at the promoted backup);
* ``check``: after the workers finished, on the controller's host: every copy of every
  slot of the store read on its own server and compared byte for byte, the global
  weights against the initial weights plus every delta the workers pushed, the counters
  against the workers' own step counts; then the store is deleted.

Timestamps are ``time.time()`` (one clock for every namespace of the machine).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from smb_client import Client
from smb_protocol import errors
from smb_protocol.placement import ExtentPlace
from smb_server.testing import copies

from . import signal_files

log = logging.getLogger(__name__)

STORE_KINDS = ("params", "deltas", "counters", "meta")   # what a SEASGD store holds
COUNTER_WORDS = 8           # smb_client.torch.store.COUNTER_WORDS
TOTAL_WORD, FINISHED_WORD = 1, 2
METRICS_TIMEOUT = 2.0       # seconds for one /metrics scrape
PROBE_PATIENCE = 40.0       # seconds the monitor waits for its probe (failover gives up after 30)


def _client(spec: dict[str, Any]) -> Client:
    return Client(spec["controller"], os.environ.get("SMB_TOKEN", ""))


# -- train ------------------------------------------------------------------------------
def train(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker of ``python -m smb_train.digits`` (``spec["argv"]``), as rank
    ``spec["rank"]`` of ``spec["world"]``, one worker per host."""
    rank, world = spec["rank"], spec["world"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), SMB_CONTROLLER=spec["controller"])
    from smb_train import digits, workers
    args = digits.build_parser().parse_args(spec["argv"])
    result: dict[str, Any] = workers.run_worker(args)
    return result


# -- monitor ----------------------------------------------------------------------------
def wait_for_store(c: Client, spec: dict[str, Any], deadline: float, kinds: tuple[str, ...] = ("meta",)) -> None:
    """Wait until the regions ``kinds`` of the store ``spec["prefix"]`` exist, looking
    every ``spec["poll"]`` seconds; errors.Timeout after ``deadline`` (time.monotonic())."""
    prefix = spec["prefix"]
    names = {f"{prefix}/{kind}" for kind in kinds}
    while not names <= {r.name for r in c.list_regions(f"{prefix}/")}:
        if time.monotonic() > deadline:
            raise errors.Timeout(f"no parameter store {prefix} within {spec['timeout']:g} s")
        time.sleep(spec.get("poll", 0.1))


def region_states(c: Client, prefix: str) -> dict[str, str]:
    """The state of every region of the store ``prefix``, by kind (``params``, ...)."""
    return {r.name.rpartition("/")[2]: r.state for r in c.list_regions(f"{prefix}/")}


def progress(counters: Any, world: int) -> tuple[int, int]:
    """(steps of all workers together, workers finished) from the store's counters region."""
    words = np.asarray(counters.read(0, (COUNTER_WORDS + world) * 8, dtype="int64"))
    return int(words[COUNTER_WORDS:].sum()), int(words[FINISHED_WORD])


def record_change(series: list[list[Any]], now: float, value: Any) -> None:
    """Append ``[now, value]`` to ``series`` unless ``value`` is the last one appended."""
    if not series or series[-1][1] != value:
        series.append([now, value])


def placement(c: Client, prefix: str) -> dict[str, Any]:
    """Where every copy of every slot of the store's regions lives."""
    out: dict[str, Any] = {}
    for kind in STORE_KINDS:
        info, _ = c.open_info(f"{prefix}/{kind}", "ro")
        primaries = [ExtentPlace.from_message(e) for e in info.extents]
        copies = [ExtentPlace.from_message(e) for e in getattr(info, "copies", ())]
        out[kind] = {"replicas": max(1, int(getattr(info, "replicas", 0) or 1)), "state": info.state,
                     "primaries": [p.server_id for p in primaries],
                     "copies": [{"slot": p.index, "server": p.server_id, "role": p.role} for p in copies],
                     "slot_bytes": [p.length for p in primaries]}
    return out


def victim(places: dict[str, Any]) -> tuple[str, str, int]:
    """The memory server to kill: the primary of the counters (every worker's every step
    touches them), which also holds a primary slot of the global weights when striped;
    returns (server id, region kind, slot)."""
    counters = places["counters"]["primaries"][0]
    if counters in places["params"]["primaries"]:
        return counters, "counters", 0
    return places["params"]["primaries"][0], "params", 0


def scrape(urls: dict[str, str]) -> dict[str, Any]:
    """``/metrics`` lines of every endpoint about replicas, repairs, regions and servers
    (name{labels} -> value); an endpoint that does not answer gets its error."""
    keep = ("replica", "repair", "regions", "servers", "promot", "sync")
    out: dict[str, Any] = {}
    for role, url in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT) as resp:
                text = resp.read().decode()
        except OSError as exc:
            out[role] = {"error": str(exc)}
            continue
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not any(k in line for k in keep):
                continue
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
        out[role] = values
    return out


class _Probe(threading.Thread):
    """After the kill: one mutation (``fetch_add`` of 0, which changes nothing) on the
    killed primary's word, through the region's failover; when it completes, the slot
    has a live primary that took it."""

    def __init__(self, region: Any, offset: int) -> None:
        super().__init__(name="probe", daemon=True)
        self.region, self.offset = region, offset
        self.started_at = self.done_at = 0.0
        self.error: str | None = None

    def run(self) -> None:
        self.started_at = time.time()
        try:
            self.region.fetch_add(self.offset, 0)
        except errors.SMBError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.done_at = time.time()


def monitor(spec: dict[str, Any]) -> dict[str, Any]:
    """Watch the store ``spec["prefix"]`` until every worker finished and every region is
    ``ready`` (or ``spec["timeout"]`` seconds); see the module's docstring."""
    sig = Path(spec["signal_dir"])
    prefix, world, target = spec["prefix"], spec["world"], spec["target_total"]
    kill_at_total = int(spec["kill_fraction"] * target) if spec.get("kill") else None
    poll, urls = spec.get("poll", 0.1), spec.get("metrics", {})
    deadline = time.monotonic() + spec["timeout"]
    result: dict[str, Any] = {"states": [], "servers": [], "progress": [], "roles": []}
    with _client(spec) as c:
        wait_for_store(c, spec, deadline)
        places = placement(c, prefix)
        result["placement"] = places
        server, kind, slot = victim(places)
        counters = c.open_region(f"{prefix}/counters")
        probe_region = c.open_region(f"{prefix}/{kind}")
        probe_offset = sum(places[kind]["slot_bytes"][:slot]) if kind == "params" else 0
        signal_files.write(sig / "placement.json", {"victim": server, "victim_region": kind, "placement": places})
        result["victim"] = {"server": server, "region": kind, "slot": slot}
        result["metrics_before"] = scrape(urls)
        probe: _Probe | None = None
        killed: dict[str, Any] | None = None
        asked = False
        last_metrics = 0.0
        while time.monotonic() < deadline:
            now = time.time()
            try:
                states = region_states(c, prefix)
                servers = {s.server_id: s.state for s in c.list_servers()}
            except errors.SMBError as exc:   # the controller is busy: look again
                log.debug("monitor: %s", exc)
                time.sleep(poll)
                continue
            record_change(result["states"], now, states)
            record_change(result["servers"], now, servers)
            try:
                total, finished = progress(counters, world)
                result["progress"].append([now, total])
            except errors.SMBError as exc:   # unreplicated counters on the killed server
                result.setdefault("counter_errors", []).append([now, f"{type(exc).__name__}: {exc}"])
                total, finished = -1, 0
            if kill_at_total is not None and not asked and total >= kill_at_total:
                signal_files.write(sig / "kill.json", {"time": now, "total": total})
                asked = True
            if asked and killed is None:
                killed = signal_files.read(sig / "killed.json")
                if killed is not None:
                    result["killed"] = killed
                    result["metrics_at_kill"] = scrape({k: u for k, u in urls.items() if k != killed["role"]})
                    probe = _Probe(probe_region, probe_offset)
                    probe.start()
            if killed is not None and "repaired_at" not in result:
                try:   # the copies' roles until the repair is over: promotion, syncing
                    roles = {k: [(p["slot"], p["server"], p["role"]) for p in v["copies"]]
                             + [(i, s, "primary") for i, s in enumerate(v["primaries"])]
                             for k, v in placement(c, prefix).items()}
                    record_change(result["roles"], now, roles)
                    # repaired: every region ready and no copy left on the killed server
                    # (a repair can be over between two looks at the states: polling
                    # them alone may never see ``degraded``)
                    if all(st == "ready" for st in states.values()) and not any(
                            server == killed["server"] for copies in roles.values() for _, server, _ in copies):
                        result["repaired_at"] = now
                except errors.SMBError as exc:
                    log.debug("monitor: %s", exc)
            if urls and now - last_metrics >= 1.0 and killed is not None:
                last_metrics = now
                result.setdefault("metrics_series", []).append(
                    [now, scrape({k: u for k, u in urls.items() if k == "ctl"})])
            if (sig / "stop.json").exists():   # the run failed: report what was seen
                result["stopped"] = True
                break
            settled = all(st == "ready" for st in states.values()) and (probe is None or not probe.is_alive()) \
                and (killed is None or "repaired_at" in result)
            if finished >= world and settled and (kill_at_total is None or killed is not None):
                break
            time.sleep(poll)
        else:
            result["timed_out"] = True
        if probe is not None:
            probe.join(timeout=min(PROBE_PATIENCE, max(0.0, deadline - time.monotonic())))
            result["probe"] = {"started_at": probe.started_at, "done_at": probe.done_at or None,
                               "error": probe.error, "region": kind, "offset": probe_offset}
        result["placement_after"] = placement(c, prefix)
        result["metrics_after"] = scrape({k: u for k, u in urls.items()
                                          if killed is None or k != killed["role"]})
    return result


# -- check ------------------------------------------------------------------------------
def check(spec: dict[str, Any]) -> dict[str, Any]:
    """Copies, global weights and counters of the store after training; then delete it."""
    prefix = spec["prefix"]
    result: dict[str, Any] = {}
    with _client(spec) as c:
        result["copies"] = {kind: copies.compare_copies(c, f"{prefix}/{kind}") for kind in STORE_KINDS}
        try:
            result.update(_weights_and_counters(c, spec))
        except errors.SMBError as exc:    # a copy that is gone (no replicas)
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["deleted"] = len(c.delete_regions(f"{prefix}/"))
    return result


def _weights_and_counters(c: Client, spec: dict[str, Any]) -> dict[str, Any]:
    from smb_client.torch import FlatModel
    from smb_train.workers import make_model
    prefix, world = spec["prefix"], spec["world"]
    result: dict[str, Any] = {}
    # global weights = initial weights + every delta pushed (float64 sums on the workers)
    initial = FlatModel(make_model(spec["seed"], spec["hidden"])).flat_params.detach().double().numpy()
    pushed = sum(np.load(Path(spec["result_dir"]) / f"seasgd-rank{r}-pushed.npy") for r in range(world))
    params = c.open_region(f"{prefix}/params")
    weights = np.asarray(params.read(0, initial.size * 4, dtype="float32"), dtype=np.float64)
    expected = initial + pushed
    scale = float(np.abs(pushed).max()) if np.size(pushed) else 0.0
    result["weights"] = {"max_abs_error": float(np.abs(weights - expected).max()),
                         "max_abs_pushed": scale, "elements": int(initial.size),
                         "float32_ulp_at_max": float(np.spacing(np.float32(np.abs(expected).max())))}
    counters = c.open_region(f"{prefix}/counters")
    words = [int(x) for x in np.asarray(counters.read(0, (COUNTER_WORDS + world) * 8, dtype="int64"))]
    counts = words[COUNTER_WORDS:]
    steps = spec["local_steps"]
    result["counters"] = {"total_word": words[TOTAL_WORD], "sum_of_counts": sum(counts),
                          "finished_word": words[FINISHED_WORD], "counts": counts, "worker_steps": steps,
                          "consistent": words[TOTAL_WORD] == sum(counts) == sum(steps)
                          and counts == steps and words[FINISHED_WORD] == world}
    params.close()
    counters.close()
    return result


def cleanup_store(spec: dict[str, Any]) -> dict[str, Any]:
    """Delete what a failed run left under ``spec["prefix"]``."""
    with _client(spec) as c:
        try:
            return {"deleted": len(c.delete_regions(f"{spec['prefix']}/"))}
        except errors.SMBError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}


MODES = {"train": train, "monitor": monitor, "check": check, "cleanup_store": cleanup_store}
