"""Hybrid training: synchronous inside a node, asynchronous across nodes.

The workers of one node form a ``torch.distributed`` group (gloo on CPU) and average
their gradients with all-reduce every step, so they hold one replica. One *leader*
per node runs :class:`~smb_client.torch.seasgd.SEASGD` against the memory box every
``update_interval`` steps (the leader's ``SEASGD.update_interval``, told to the whole
node) and broadcasts the updated weights to its group. Nodes never wait for each other.

The node's all-reduce runs on whatever backend its group has: over gloo the memory box
takes no part in it; on the ``smb`` backend (``new_node_groups(..., backend="smb")``,
or a world initialized with it) every sum is a round of the memory box's collective,
and ``compression=`` sends the gradients as 16-bit values there, summed in float32 on
the memory servers, as :class:`~smb_client.torch.SyncDataParallel`'s option does.

:attr:`HybridSEASGD.times` keeps each step's seconds by phase (``sum``: the node's
all-reduce, the leader's read of the global weights and the broadcast of the result;
``push``: the leader's wait for its previous delta; ``barrier``: :meth:`HybridSEASGD.agree`),
the waits being ``smb::hybrid.*`` ranges in a ``torch.profiler`` trace.

Buffers (batch-norm statistics) stay each worker's own; the leader of node 0 (SEASGD's
rank 0) publishes its buffers into the store with every update and when it closes, so
``store.load_into`` and ``store.save`` give the global weights with fitting statistics.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from smb_protocol.errors import InvalidArgument

from .backend import SMBProcessGroup
from .flat import FlatModel, GradientHooks
from .layout import Bucket
from .seasgd import SEASGD
from .steps import StepTimes
from .sync import COMPRESSIONS, DEFAULT_BUCKET_BYTES, compression_types

log = logging.getLogger(__name__)


def node_groups(world: int, local_world: int) -> list[list[int]]:
    """Ranks grouped by node: ``local_world`` consecutive ranks per node (torchrun's order)."""
    if local_world < 1 or world % local_world:
        raise InvalidArgument(f"world size {world} is not a multiple of the local world size {local_world}")
    return [list(range(n * local_world, (n + 1) * local_world)) for n in range(world // local_world)]


def new_node_groups(world: int, local_world: int,
                    backend: str | None = None) -> tuple[list[list[int]], list[dist.ProcessGroup]]:
    """Create one process group per node (every rank must call this, in the same order);
    ``backend``: the groups' (``"gloo"``, ``"smb"``; None: the world's)."""
    ranks = node_groups(world, local_world)
    return ranks, [dist.new_group(r, backend=backend) for r in ranks]


def smb_group(group: Any) -> SMBProcessGroup | None:
    """The ``smb`` process group behind ``group``, None when it runs on another backend."""
    if isinstance(group, SMBProcessGroup):   # what torch hands out for a Python backend's group
        return group
    try:
        pg = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return pg if isinstance(pg, SMBProcessGroup) else None


class HybridSEASGD:
    """One worker of the hybrid scheme.

    ``flat`` is this worker's :class:`FlatModel`; ``group`` its node's process group and
    ``group_ranks`` the global ranks in it (the first is the leader). The leader passes
    its ``seasgd`` (built on a store with one delta slot per node); the others pass
    None. Use::

        hy.zero_grad(); loss.backward(); hy.synchronize(); optimizer.step(); hy.after_step()

    The elastic update runs every ``seasgd.update_interval`` steps: the leader sends
    its interval to the node's workers when they construct this (a collective call on
    the group). ``update_interval``, when given on any worker, must equal it
    (InvalidArgument on every worker of the node otherwise).

    ``compression`` (a node group on the ``smb`` backend, float32 parameters): the
    node's gradients go to the memory box as 16-bit values (``"bf16"``, ``"fp16"``),
    are summed there in float32 and come back rounded once (``"bf16-full"``,
    ``"fp16-full"``: as the float32 sum). The names and checks are
    :class:`~smb_client.torch.SyncDataParallel`'s; a gloo group refuses it
    (InvalidArgument: the memory box does not carry its sum). Every worker of the node
    passes the same.

    :attr:`times` (:class:`~smb_client.torch.StepTimes`, scheme ``hybrid``) keeps each
    step's seconds by phase (see the module's notes); ``log_every`` and ``writer`` as
    for :class:`~smb_client.torch.SyncDataParallel`. A step ends in :meth:`after_step`.
    """

    def __init__(self, flat: FlatModel, group: Any, group_ranks: Sequence[int], *,
                 seasgd: SEASGD | None, update_interval: int | None = None, overlap: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, compression: str | None = None,
                 log_every: int = 0, writer: Any = None) -> None:
        rank = dist.get_rank()
        if rank not in group_ranks:
            raise InvalidArgument(f"rank {rank} is not in its node group {list(group_ranks)}")
        self.leader = group_ranks[0]
        self.is_leader = rank == self.leader
        if self.is_leader != (seasgd is not None):
            raise InvalidArgument("the node leader (first rank of the group) and only it passes seasgd")
        if update_interval is not None and update_interval < 1:
            raise InvalidArgument(f"update_interval must be >= 1, got {update_interval}")
        self.flat = flat
        self.group = group
        self.group_size = len(group_ranks)
        self.seasgd = seasgd
        self._pg = smb_group(group)
        self.wire, self.full_sum = self._compression(compression)
        self.update_interval = self._agree_interval(update_interval)
        self.step = 0
        self.comm_wait = 0.0   # seconds waiting for all-reduce (after backward) and broadcast
        self.times = StepTimes("hybrid", log_every, writer)
        self._hooks = GradientHooks(flat, bucket_bytes, self._reduce_bucket) if overlap else None

    def _compression(self, compression: str | None) -> tuple[str | None, bool]:
        """The wire type and full-sum choice of ``compression`` (see the class)."""
        if compression in COMPRESSIONS:
            if self._pg is None:
                raise InvalidArgument(
                    f"compression={compression!r} needs the node groups on the smb backend, whose sums "
                    f"the memory box carries (new_node_groups(..., backend=\"smb\")); this node's group "
                    f"runs on {dist.get_backend(self.group)!r}")
            if self.flat.dtype is None:
                raise InvalidArgument(f"compression={compression!r} needs parameters of one element type; "
                                      "this model mixes types")
        return compression_types(compression, self.flat.dtype, "collective")

    def _agree_interval(self, asked: int | None) -> int:
        """The leader's SEASGD interval on every worker of the node; a worker that asked
        for another one makes all of them raise InvalidArgument. Broadcast and
        all-gather only, so that a group on the smb backend (SUM and AVG) runs it too."""
        interval = torch.tensor([self.seasgd.update_interval if self.seasgd is not None else 0],
                                dtype=torch.int64)
        dist.broadcast(interval, src=self.leader, group=self.group)
        leader = int(interval.item())
        mine = torch.tensor([asked if asked is not None and asked != leader else 0], dtype=torch.int64)
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(self.group_size)]
        dist.all_gather(everyone, mine, group=self.group)
        conflict = next((int(t.item()) for t in everyone if int(t.item())), 0)
        if conflict:
            raise InvalidArgument(f"update_interval={conflict} on a worker of the node, but the "
                                  f"leader's SEASGD updates every {leader} steps: pass the same interval "
                                  "to SEASGD, or leave HybridSEASGD's out")
        return leader

    def _reduce(self, offset: int, length: int) -> list[Any]:
        """Start summing bytes ``[offset, offset+length)`` of the gradients over the node."""
        views = [view for _, view in self.flat.typed(self.flat.flat_grads, offset, length)]
        if self.wire is not None:
            assert self._pg is not None
            return [self._pg.allreduce_wire(views, self.wire, self.full_sum)]
        return [dist.all_reduce(view, group=self.group, async_op=True) for view in views]

    def _reduce_bucket(self, bucket: Bucket) -> list[Any]:
        return self._reduce(bucket.offset, bucket.length)

    def broadcast_params(self) -> None:
        """Give every worker of the node the leader's weights."""
        dist.broadcast(self.flat.flat_params, src=self.leader, group=self.group)

    def zero_grad(self) -> None:
        """Zero the local gradients."""
        self.flat.zero_grad()

    def synchronize(self) -> None:
        """Average the gradients over the node."""
        t0 = time.perf_counter()
        if self._hooks is not None:
            pending = self._hooks.finish()
        else:
            self.flat.collect_grads()
            pending = [self._reduce(0, self.flat.layout.slot_bytes)]
        with self.times.phase("sum"):
            for works in pending:
                for work in works:
                    work.wait()
        self.flat.scale_(self.flat.flat_grads, 1.0 / self.group_size)
        self.comm_wait += time.perf_counter() - t0

    def after_step(self) -> bool:
        """Count one step; every ``update_interval`` steps the leader runs an elastic
        update against the memory box and broadcasts the result (True then)."""
        self.step += 1
        if self.step % self.update_interval:
            self.times.end_step()
            return False
        t0 = time.perf_counter()
        if self.seasgd is not None:   # its own waits, timed by SEASGD, go to this step's phases
            pushed, read = self.seasgd.push_wait, self.seasgd.read_wait
            self.seasgd.update()
            self.times.add("push", self.seasgd.push_wait - pushed)
            self.times.add("sum", self.seasgd.read_wait - read)
        with self.times.phase("sum"):
            self.broadcast_params()
        self.comm_wait += time.perf_counter() - t0
        self.times.end_step()
        return True

    def agree(self, flag: bool) -> bool:
        """True on every worker of the node when any of them passes True (for stopping)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self.times.phase("barrier"):
            dist.all_reduce(t, group=self.group)   # SUM: every backend has it
        return bool(t.item())

    def close(self) -> None:
        """Remove the hooks; the leader finishes its SEASGD worker (its last push)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self.seasgd is not None:
            self.seasgd.finish()
