"""A training job that sets itself up and cleans up after itself.

    with smb_client.torch.job("myjob", model, checkpoint="myjob.pt", optimizer=opt) as j:
        dp = j.sync()                       # SyncDataParallel over the job's store
        for step in range(j.step, steps):
            ...                             # the DDP loop
            j.save(step=step + 1)           # rank 0 writes the checkpoint

On entry (every worker; rank and world size from torchrun's variables,
:class:`~smb_client.torch.launch.WorkerEnv`):

* the job's client (made by the job from ``SMB_CONTROLLER``/``SMB_TOKEN`` unless one
  is given) takes an owner id made from the job's name and ``TORCHELASTIC_RUN_ID``
  (:attr:`Job.owner`), the same in every worker and in every restart of the group,
  and renews its lease (each worker makes a small region ``<name>/lease/<rank>-...``
  under it, which renews the lease at once and keeps it renewed); the store's regions
  are made with that lease (``lease`` seconds, :data:`LEASE`), so they outlive a
  restart of the group under ``torchrun --max-restarts`` and are deleted by the
  controller once no worker renewed them for ``lease`` seconds (the job crashed for
  good);
* rank 0 creates the store (replacing what a dead run of the same name left), or,
  in a restarted group (``TORCHELASTIC_RESTART_COUNT`` > 0) that finds the store still
  there, everybody attaches to it and goes on from its weights (:attr:`Job.resumed`
  ``"store"``);
* given a ``checkpoint`` file that exists, a new store starts from its weights
  (:attr:`Job.resumed` ``"checkpoint"``) and every worker loads its optimizer state into
  ``optimizer`` and its step into :attr:`Job.step` (each worker reads the file: on
  several hosts, put it where all of them see it).

On a normal exit every worker closes its trainers (publishing the final weights), all
meet at the barrier ``<name>/end``, and rank 0 deletes every region under ``<name>/``.
On an exception the handles are closed and the regions left to the lease: a restarted
group picks them up, and nothing is left once the job is gone for good.
"""
from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from smb_protocol.errors import InvalidArgument

from ..client import Client, connect
from ..coord import controller_barrier
from . import checkpoint as ckpt
from .counters import SharedCounters
from .launch import READY_TIMEOUT, WorkerEnv, open_store
from .seasgd import SEASGD
from .store import SCHEMES, ParameterStore
from .sync import BARRIER_TIMEOUT, DEFAULT_BUCKET_BYTES, DEFAULT_PUBLISH_EVERY, SyncDataParallel

log = logging.getLogger(__name__)

__all__ = ["END_TIMEOUT", "LEASE", "Job", "job"]

LEASE = 60.0            # seconds the job's regions outlive its last worker (and bridge a restart)
END_TIMEOUT = 300.0     # seconds the workers wait for each other at the end
MARKER_BYTES = 64       # each worker's region under <name>/lease/, which holds the job's lease


class Job:
    """One worker's part of the training job ``name`` (see the module): its client,
    :attr:`store`, :attr:`env`, and the trainers made by :meth:`sync` and :meth:`seasgd`.
    Use it as a context manager (:func:`job`), or call :meth:`start` and
    :meth:`finish` (or :meth:`abandon`). Owns its client unless ``client`` is given;
    the model and the optimizer stay the caller's.

    ``checkpoint`` (a file), ``optimizer``, ``lease`` (seconds, None: no lease),
    ``ready_timeout`` and ``end_timeout`` (seconds) are the job's (see the module);
    ``client`` and ``env`` default to ones made from the environment. ``resume=False``:
    a restarted group does not go on from the earlier attempt's store but replaces it
    and starts afresh (from the ``checkpoint`` when there is one), as a new launch does.

    The store: ``scheme`` is the trainer it is sized for, ``"sync"`` (the default,
    for :meth:`sync`) or ``"seasgd"``/``"hybrid"`` (a private delta slot per worker,
    for :meth:`seasgd`; without them :meth:`seasgd` still trains, keeping no private
    delta). ``placement``, ``grad_slots``, ``delta_slots``, ``stripe_unit``,
    ``num_servers``, ``buffers`` and ``replicas`` are :meth:`ParameterStore.create`'s;
    the job sets its ``workers`` (the world size), ``lease`` and ``replace`` itself.
    """

    def __init__(self, name: str, model: torch.nn.Module, *, checkpoint: str | os.PathLike[str] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, client: Client | None = None,
                 env: WorkerEnv | None = None, lease: float | None = LEASE,
                 ready_timeout: float = READY_TIMEOUT, end_timeout: float = END_TIMEOUT, resume: bool = True,
                 scheme: str | None = None, placement: str = "striped", grad_slots: int | None = None,
                 delta_slots: int | None = None, stripe_unit: int | None = None, num_servers: int = 0,
                 buffers: bool = True, replicas: int = 1) -> None:
        if scheme is not None and scheme not in SCHEMES:
            raise InvalidArgument(f"unknown scheme {scheme!r}: one of {', '.join(SCHEMES)}")
        self.name = name
        self.model = model
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.optimizer = optimizer
        self.env = env if env is not None else WorkerEnv.from_env()
        self.lease = lease
        self.ready_timeout = ready_timeout
        self.end_timeout = end_timeout
        self.resume = resume
        #: the :meth:`ParameterStore.create` options of the job's store
        self.create: dict[str, Any] = {
            "scheme": scheme, "placement": placement, "grad_slots": grad_slots, "delta_slots": delta_slots,
            "stripe_unit": stripe_unit, "num_servers": num_servers, "buffers": buffers, "replicas": replicas}
        self._given_client = client
        self.client: Client | None = None
        self._store: ParameterStore | None = None
        self.step = 0                   # the step to go on from (a checkpoint's)
        self.resumed: str | None = None  # "store", "checkpoint" or None (a fresh start)
        self._trainers: list[SyncDataParallel | SEASGD] = []
        self._ended = False

    @property
    def rank(self) -> int:
        """This worker's rank (torchrun's ``RANK``)."""
        return self.env.rank

    @property
    def world(self) -> int:
        """The number of workers (torchrun's ``WORLD_SIZE``)."""
        return self.env.world_size

    @property
    def store(self) -> ParameterStore:
        """The job's parameter store (after :meth:`start`)."""
        if self._store is None:
            raise InvalidArgument(f"job {self.name!r} has not started: use it in a with block, or call start()")
        return self._store

    @property
    def owner(self) -> str:
        """The owner id of the job's leases (32 hex digits, from the job's name and
        ``TORCHELASTIC_RUN_ID``): the same in every worker and restart."""
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        return hashlib.sha256(f"smb-job\0{self.name}\0{run}".encode()).hexdigest()[:32]

    # -- the start ------------------------------------------------------------------
    def start(self) -> Job:
        """Connect, create or attach the store, resume (see the module); returns self."""
        client = self._given_client if self._given_client is not None else connect()
        self.client = client
        try:
            if self._given_client is None and self.lease is not None:
                client.owner = self.owner
                # a region of this worker's own under the job's lease renews the lease at
                # once (a restarted group's bridge) and keeps renewing it while it lives
                client.create_region(f"{self.name}/lease/{self.rank}-{uuid.uuid4().hex[:12]}", MARKER_BYTES,
                                     placement="single", lease=self.lease)
            saved = self._read_checkpoint()
            state = saved[0] if saved is not None else None
            restarted = self.env.restart_count > 0 and self.resume

            def load(store: ParameterStore) -> None:
                if state is not None:
                    store.load_state_dict(state)
            self._store = open_store(client, self.env, self.name, self.model, ready_timeout=self.ready_timeout,
                                     resume=restarted, on_create=load, workers=self.world, lease=self.lease,
                                     replace=True, attempt=self.env.restart_count, **self.create)
            if self._store.attempt < self.env.restart_count:
                self.resumed = "store"          # an earlier attempt's store: its weights
            elif state is not None:
                self.resumed = "checkpoint"     # made by this attempt from the checkpoint
            if saved is not None:
                _, opt_state, extra = saved
                if self.optimizer is not None and opt_state is not None:
                    self.optimizer.load_state_dict(opt_state)
                self.step = int(extra.get("step", 0))
            log.info("job %s: rank %d of %d started (%s)", self.name, self.rank, self.world,
                     f"resumed from the {self.resumed}" if self.resumed else "fresh")
        except BaseException:
            self._close_client()
            raise
        return self

    def _read_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]] | None:
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        return ckpt.read(self.checkpoint)

    # -- trainers -------------------------------------------------------------------
    def sync(self, *, overlap: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             counters: SharedCounters | None = None, barrier_timeout: float = BARRIER_TIMEOUT,
             publish_every: int = DEFAULT_PUBLISH_EVERY, buffers: str = "broadcast", exchange: str = "auto",
             worker_hosts: Sequence[str] | None = None, check_env: bool = True,
             priority: bool = True, log_every: int = 0, writer: Any = None,
             compression: str | None = None) -> SyncDataParallel:
        """A :class:`SyncDataParallel` over the job's store, this worker's rank and the
        world size (closed by :meth:`finish`); the options are its own."""
        dp = SyncDataParallel(self.store, self.rank, self.world, overlap=overlap, bucket_bytes=bucket_bytes,
                              counters=counters, barrier_timeout=barrier_timeout, publish_every=publish_every,
                              buffers=buffers, exchange=exchange, worker_hosts=worker_hosts,
                              check_env=check_env, priority=priority, log_every=log_every, writer=writer,
                              compression=compression)
        self._trainers.append(dp)
        return dp

    def seasgd(self, *, moving_rate: float | None = None, update_interval: int = 4,
               keep_deltas: bool | None = None, publish_buffers: bool = True, log_every: int = 0,
               writer: Any = None) -> SEASGD:
        """A :class:`SEASGD` worker over the job's store (closed by :meth:`finish`); the
        options are its own. ``keep_deltas`` (default: when the store has this worker's
        delta slot, i.e. the job was made with ``scheme="seasgd"``) writes every delta
        into the worker's private slot as well."""
        if keep_deltas is None:
            keep_deltas = self.store.delta_slots > self.rank
            if not keep_deltas:
                log.info("job %s: the store has no delta slot for rank %d (job(..., scheme=\"seasgd\") "
                         "reserves them): SEASGD keeps no private delta", self.name, self.rank)
        worker = SEASGD(self.store, self.rank, self.world, moving_rate=moving_rate,
                        update_interval=update_interval, keep_deltas=keep_deltas, publish_buffers=publish_buffers,
                        log_every=log_every, writer=writer)
        self._trainers.append(worker)
        return worker

    def save(self, path: str | os.PathLike[str] | None = None, *, step: int | None = None) -> None:
        """Rank 0 writes a checkpoint (the others return at once) to ``path`` (default:
        the job's ``checkpoint``): the weights (the local replica's under
        :meth:`sync`, where every replica is the same; else the store's global weights),
        the optimizer's state and ``step``."""
        target = Path(path) if path is not None else self.checkpoint
        if target is None:
            raise InvalidArgument("save() needs a path: the job was started without checkpoint=")
        if self.rank != 0:
            return
        synchronous = any(isinstance(t, SyncDataParallel) for t in self._trainers)
        state = self.model.state_dict() if synchronous else self.store.state_dict()
        extra = {"step": step} if step is not None else {}
        ckpt.save(state, target, self.optimizer, **extra)

    # -- the end --------------------------------------------------------------------
    def finish(self) -> None:
        """Close the trainers (publishing), meet the other workers at ``<name>/end``;
        rank 0 deletes every region under ``<name>/``. Closes the job's client."""
        if self._ended:
            return
        self._ended = True
        try:
            for t in self._trainers:
                t.close()
            assert self.client is not None
            controller_barrier(self.client, f"{self.name}/end", self.world, timeout=self.end_timeout,
                               rank=self.rank)
            self.store.close()
            if self.rank == 0:
                ParameterStore.destroy_prefix(self.client, self.name)
                left = self.client.delete_regions(f"{self.name}/")
                log.info("job %s finished; deleted its regions (%d besides the store's)", self.name, len(left))
        finally:
            self._close_client()

    def abandon(self) -> None:
        """Close the trainers (without publishing) and the handles; the regions stay
        for a restarted group, or until their lease ran out."""
        if self._ended:
            return
        self._ended = True
        try:
            for t in self._trainers:
                if isinstance(t, SyncDataParallel):
                    t.close(publish=False)
                else:
                    t.close()
            if self._store is not None:
                self._store.close()
        except Exception as exc:   # the error that ended the job is the one to see
            log.warning("job %s: closing after a failure: %r", self.name, exc)
        finally:
            self._close_client()

    def _close_client(self) -> None:
        if self._given_client is None and self.client is not None:
            self.client.close()

    def __enter__(self) -> Job:
        """:meth:`start` the job."""
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """:meth:`finish` after a normal exit, :meth:`abandon` after an exception."""
        if exc_type is None:
            self.finish()
        else:
            self.abandon()


def job(name: str, model: torch.nn.Module, *, checkpoint: str | os.PathLike[str] | None = None,
        optimizer: torch.optim.Optimizer | None = None, client: Client | None = None,
        env: WorkerEnv | None = None, lease: float | None = LEASE,
        ready_timeout: float = READY_TIMEOUT, end_timeout: float = END_TIMEOUT, resume: bool = True,
        scheme: str | None = None, placement: str = "striped", grad_slots: int | None = None,
        delta_slots: int | None = None, stripe_unit: int | None = None, num_servers: int = 0,
        buffers: bool = True, replicas: int = 1) -> Job:
    """The job ``name`` training ``model`` (the options are :class:`Job`'s):
    ``with job(...) as j:`` starts it and finishes or abandons it. For
    :meth:`Job.seasgd`, ``scheme="seasgd"`` gives every worker its delta slot."""
    return Job(name, model, checkpoint=checkpoint, optimizer=optimizer, client=client, env=env, lease=lease,
               ready_timeout=ready_timeout, end_timeout=end_timeout, resume=resume, scheme=scheme,
               placement=placement,
               grad_slots=grad_slots, delta_slots=delta_slots, stripe_unit=stripe_unit,
               num_servers=num_servers, buffers=buffers, replicas=replicas)
