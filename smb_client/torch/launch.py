"""Worker identity from ``torchrun`` and the create-or-attach handshake.

``torchrun`` (and ``smb train``) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every
worker; a process started without them is a single worker (rank 0 of 1). The memory
box itself is found through ``SMB_CONTROLLER`` and ``SMB_TOKEN``.

Restarts: ``torchrun --max-restarts N`` starts the whole worker group again after one of
them died, with ``TORCHELASTIC_RESTART_COUNT`` counting the restarts. A restarted group
finds the store its first attempt created still in the memory box (the global weights,
the counters) and attaches to it instead of creating a new one (:func:`open_store`'s
``resume``), so training goes on from the global weights rather than from scratch.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from smb_protocol.errors import BarrierTimeout, InvalidArgument

from ..coord import REPORT_EVERY, PartiesMissing, controller_barrier, ranks_text
from . import failure
from .flat import FlatModel
from .store import ParameterStore

if TYPE_CHECKING:
    import torch

    from ..client import Client

log = logging.getLogger(__name__)

READY_TIMEOUT = 300.0  # seconds the others wait for the master to create the store
FAILURE_POLL = 1.0     # seconds between the others' looks for the master's creation error


@dataclass(frozen=True)
class WorkerEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    restart_count: int = 0   # times torchrun started this worker group again

    @property
    def is_master(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        """The number of nodes (hosts) of the launch."""
        return self.world_size // self.local_world_size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the torchrun variables (InvalidArgument when they contradict each other)."""
        env = os.environ if environ is None else environ

        def number(name: str, default: int) -> int:
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise InvalidArgument(f"{name}={raw!r} is not an integer") from None

        rank = number("RANK", 0)
        world = number("WORLD_SIZE", 1)
        local_rank = number("LOCAL_RANK", rank if "LOCAL_WORLD_SIZE" not in env else 0)
        local_world = number("LOCAL_WORLD_SIZE", world)
        node = number("GROUP_RANK", rank // max(1, local_world))
        if world < 1 or not 0 <= rank < world:
            raise InvalidArgument(f"RANK={rank} must lie in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
        if local_world < 1 or world % local_world or not 0 <= local_rank < local_world:
            raise InvalidArgument(f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world} do not fit "
                                  f"WORLD_SIZE={world}")
        return cls(rank, world, local_rank, local_world, node,
                   env.get("MASTER_ADDR", "127.0.0.1"), number("MASTER_PORT", 29500),
                   number("TORCHELASTIC_RESTART_COUNT", 0))


def check_torchrun(rank: int, world: int, what: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise InvalidArgument, naming both numbers, when ``rank`` or ``world`` contradict
    torchrun's ``RANK`` or ``WORLD_SIZE`` (each checked where set; ``LOCAL_RANK`` must fit
    them, see :meth:`WorkerEnv.from_env`). Nothing is checked outside torchrun."""
    env = os.environ if environ is None else environ
    if not any(env.get(k, "") != "" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return
    got = WorkerEnv.from_env(env)
    fix = "pass WorkerEnv.from_env().rank and .world_size, or check_env=False if only some of them train together"
    if env.get("WORLD_SIZE", "") != "" and world != got.world_size:
        raise InvalidArgument(f"{what}(rank={rank}, world={world}), but torchrun started WORLD_SIZE="
                              f"{got.world_size} workers: the workers would wait for {world} that never "
                              f"all come; {fix}")
    if env.get("RANK", "") != "" and rank != got.rank:
        raise InvalidArgument(f"{what}(rank={rank}, world={world}), but this worker is RANK={got.rank} of "
                              f"torchrun's {got.world_size}; {fix}")


def open_store(client: Client, env: WorkerEnv, prefix: str, model: torch.nn.Module | FlatModel, *,
               ready_timeout: float = READY_TIMEOUT, members: int | None = None,
               creator: bool | None = None, resume: bool | None = None,
               on_create: Callable[[ParameterStore], None] | None = None,
               scheme: str | None = None, placement: str = "striped", grad_slots: int | None = None,
               delta_slots: int | None = None, workers: int = 1, stripe_unit: int | None = None,
               num_servers: int = 0, replace: bool = False, buffers: bool = True, lease: float | None = None,
               replicas: int = 1, attempt: int = 0) -> ParameterStore:
    """The master creates the store (``scheme`` through ``attempt`` are
    :meth:`ParameterStore.create`'s options); everybody meets at the barrier ``<prefix>/ready``; the others then attach
    by name and load the master's parameters, so that all start from the same weights.
    The master does not wait for them to load: under an asynchronous scheme (SEASGD) it
    may train and update the global weights meanwhile, and a worker that loads after that
    starts from the global weights as they are then, which is what elastic averaging
    would move it towards anyway; a caller that needs every worker's start equal meets
    the others at a barrier of its own after this returns.

    ``members`` is how many processes call this (default: every worker; more than
    ``env.world_size`` raises InvalidArgument at once); ``creator`` whether this one
    creates (default: rank 0). ``resume`` (default: when torchrun
    restarted the group, ``TORCHELASTIC_RESTART_COUNT`` > 0): a store already under
    ``prefix`` is kept and everybody, the master included, attaches to it and loads the
    stored weights; without one, the master creates it as usual. ``on_create(store)``
    runs at the master after it created the store and before the others attach (to
    load a checkpoint into it, say); an error there is published as a creation error.

    When the creation fails, the master leaves its error in ``<prefix>/failed`` (under
    the store's ``lease`` when it has one, so it goes with the job) and raises it; the
    others, who look for that record about every second while they wait, raise the same
    error class within seconds (not after ``ready_timeout``), its message saying that
    the master failed and why.
    """
    parties = env.world_size if members is None else members
    rank = env.rank if members is None else None     # among some members, ranks are not theirs
    creates = env.is_master if creator is None else creator
    if parties < 1:
        raise InvalidArgument(f"members must be >= 1, got {parties}")
    if parties > env.world_size:
        raise InvalidArgument(f"open_store(members={parties}), but the launch has WORLD_SIZE={env.world_size} "
                              f"workers: {parties} members would never all arrive at {prefix}/ready; members "
                              "counts the workers that call open_store (default: all of them)")
    store = None
    name = f"{prefix}/ready"
    if resume is None:
        resume = env.restart_count > 0
    meta = ParameterStore.region_name(prefix, "meta")
    if creates and resume and any(r.name == meta for r in client.list_regions(meta)):
        log.info("resuming from the parameter store under %s (restart %d)", prefix, env.restart_count)
        creates = False
        controller_barrier(client, name, parties, timeout=ready_timeout, rank=rank)
    elif creates:
        try:
            store = ParameterStore.create(
                client, prefix, model, scheme=scheme, placement=placement, grad_slots=grad_slots,
                delta_slots=delta_slots, workers=workers, stripe_unit=stripe_unit, num_servers=num_servers,
                replace=replace, buffers=buffers, lease=lease, replicas=replicas, attempt=attempt)
            if on_create is not None:
                on_create(store)
        except BaseException as exc:
            failure.publish(client, prefix, exc, lease=lease)
            raise
        controller_barrier(client, name, parties, timeout=ready_timeout, rank=rank)
    else:
        _await_master(client, prefix, name, parties, ready_timeout, rank)
    if store is None:
        store = ParameterStore.attach(client, prefix, model, timeout=ready_timeout)
    return store


def _await_master(client: Client, prefix: str, name: str, parties: int, timeout: float,
                  rank: int | None = None) -> None:
    """The barrier ``name``, waited for in slices of :data:`FAILURE_POLL` seconds with a
    look for the master's failure record between them (a caller whose wait times out
    leaves the barrier, so arriving again is safe)."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    since = time.time()
    reported = started
    missing: list[int] | None = None
    while True:
        failure.check(client, prefix, since)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PartiesMissing(f"barrier {name!r}: the master did not create parameter store {prefix!r}, "
                                 f"or not all {parties} parties arrived, within {timeout:g} s"
                                 f"{ranks_text(missing)}", what=f"barrier {name}", parties=parties,
                                 missing=missing)
        try:
            client.barrier(name, parties, timeout=min(FAILURE_POLL, remaining), rank=rank)
            return
        except BarrierTimeout as exc:
            missing = exc.missing
            if time.monotonic() - reported >= REPORT_EVERY:
                reported = time.monotonic()
                log.warning("barrier %s: waiting for %.0f s for the master to create parameter store %s "
                            "and for all %d parties (%s)", name, reported - started, prefix, parties, exc)
