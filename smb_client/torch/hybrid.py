"""Hybrid training: synchronous inside a node, asynchronous across nodes.

The workers of one node form a ``torch.distributed`` group (gloo on CPU) and average
their gradients with all-reduce every step, so they hold one replica. One *leader*
per node runs :class:`~smb_client.torch.seasgd.SEASGD` against the memory box every
``update_interval`` steps (the leader's ``SEASGD.update_interval``, told to the whole
node) and broadcasts the updated weights to its group. Nodes never wait for each other.

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

from .flat import FlatModel, GradientHooks
from .layout import Bucket
from .seasgd import SEASGD
from .sync import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)


def node_groups(world: int, local_world: int) -> list[list[int]]:
    """Ranks grouped by node: ``local_world`` consecutive ranks per node (torchrun's order)."""
    if local_world < 1 or world % local_world:
        raise InvalidArgument(f"world size {world} is not a multiple of the local world size {local_world}")
    return [list(range(n * local_world, (n + 1) * local_world)) for n in range(world // local_world)]


def new_node_groups(world: int, local_world: int) -> tuple[list[list[int]], list[dist.ProcessGroup]]:
    """Create one process group per node (every rank must call this, in the same order)."""
    ranks = node_groups(world, local_world)
    return ranks, [dist.new_group(r) for r in ranks]


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
    """

    def __init__(self, flat: FlatModel, group: Any, group_ranks: Sequence[int], *,
                 seasgd: SEASGD | None, update_interval: int | None = None, overlap: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
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
        self.update_interval = self._agree_interval(update_interval)
        self.step = 0
        self.comm_wait = 0.0   # seconds waiting for all-reduce (after backward) and broadcast
        self._hooks = GradientHooks(flat, bucket_bytes, self._reduce_bucket) if overlap else None

    def _agree_interval(self, asked: int | None) -> int:
        """The leader's SEASGD interval on every worker of the node; a worker that asked
        for another one makes all of them raise InvalidArgument."""
        interval = torch.tensor([self.seasgd.update_interval if self.seasgd is not None else 0],
                                dtype=torch.int64)
        dist.broadcast(interval, src=self.leader, group=self.group)
        leader = int(interval.item())
        conflict = torch.tensor([asked if asked is not None and asked != leader else 0], dtype=torch.int64)
        dist.all_reduce(conflict, op=dist.ReduceOp.MAX, group=self.group)
        if int(conflict.item()):
            raise InvalidArgument(f"update_interval={int(conflict.item())} on a worker of the node, but the "
                                  f"leader's SEASGD updates every {leader} steps: pass the same interval "
                                  "to SEASGD, or leave HybridSEASGD's out")
        return leader

    def _reduce_bucket(self, bucket: Bucket) -> list[Any]:
        return [dist.all_reduce(view, group=self.group, async_op=True)
                for _, view in self.flat.typed(self.flat.flat_grads, bucket.offset, bucket.length)]

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
            for works in self._hooks.finish():
                for work in works:
                    work.wait()
        else:
            self.flat.collect_grads()
            for _, view in self.flat.typed(self.flat.flat_grads, 0, self.flat.layout.slot_bytes):
                dist.all_reduce(view, group=self.group)
        self.flat.scale_(self.flat.flat_grads, 1.0 / self.group_size)
        self.comm_wait += time.perf_counter() - t0

    def after_step(self) -> bool:
        """Count one step; every ``update_interval`` steps the leader runs an elastic
        update against the memory box and broadcasts the result (True then)."""
        self.step += 1
        if self.step % self.update_interval:
            return False
        t0 = time.perf_counter()
        if self.seasgd is not None:
            self.seasgd.update()
        self.broadcast_params()
        self.comm_wait += time.perf_counter() - t0
        return True

    def agree(self, flag: bool) -> bool:
        """True on every worker of the node when any of them passes True (for stopping)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def close(self) -> None:
        """Remove the hooks; the leader finishes its SEASGD worker (its last push)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self.seasgd is not None:
            self.seasgd.finish()
