"""Weights of a torch model from a trainer to many readers (:mod:`smb_client.weights`).

    pub = publisher(client, "rl/policy", model, versions=3)
    publish(pub, model, version=step)                       # a trainer's step

    sub = Subscriber(client, "rl/policy")
    version = load(sub, reader_model, newer_than=held, timeout=60)   # in place

:func:`load` reads straight into the model's parameters and buffers (CPU), each in its
own float type (a bfloat16 reader of a float32 trainer converts piece by piece), each
whole or the :class:`~smb_client.weights.Shard` that :func:`tensor_parallel` names for
it. A trainer spread over ranks publishes with ``ranks=`` (each rank its own tensors).
"""
from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from smb_protocol.dtypes import STORAGE, resolve
from smb_protocol.errors import InvalidArgument

from ..client import Client
from ..weights import Publisher, Shard, Snapshot, Subscriber

log = logging.getLogger(__name__)

StateLike = torch.nn.Module | Mapping[str, torch.Tensor]


def state_of(obj: StateLike) -> dict[str, torch.Tensor]:
    """The tensors of a module (its ``state_dict()``: parameters and buffers, sharing
    their memory) or of a state dict, detached."""
    state = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
    return {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}


def publisher(client: Client, name: str, obj: StateLike, *, versions: int = 2, replicas: int = 1,
              stripe_unit: int = 0, num_servers: int = 0, lease: float | None = None, exist_ok: bool = False,
              ranks: int = 1, rank: int = 0) -> Publisher:
    """A :class:`Publisher` for the tensors of ``obj``; the options are
    :meth:`Publisher.create`'s."""
    return Publisher.create(client, name, state_of(obj), versions=versions, replicas=replicas,
                            stripe_unit=stripe_unit, num_servers=num_servers, lease=lease, exist_ok=exist_ok,
                            ranks=ranks, rank=rank)


def publish(pub: Publisher, obj: StateLike, version: int | None = None) -> int:
    """Publish the tensors of ``obj`` (CPU or CUDA) as ``version``; returns it."""
    return pub.publish(state_of(obj), version)


def tensor_parallel(names: Iterable[str], rules: Mapping[str, int], index: int, parts: int) -> dict[str, Shard]:
    """The shards of a tensor-parallel reader: each name matching a pattern of ``rules``
    (``fnmatch``, e.g. ``{"*.q_proj.weight": 0, "*.o_proj.weight": 1}``: pattern -> dim)
    is read as part ``index`` of ``parts`` along that dim; the first match wins."""
    out: dict[str, Shard] = {}
    for name in names:
        for pattern, dim in rules.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = Shard(dim, index, parts)
                break
    return out


def load(sub: Subscriber, obj: StateLike, *, shards: Mapping[str, Shard | None] | None = None,
         newer_than: int | None = None, timeout: float | None = None, version: int | None = None,
         strict: bool = True) -> int:
    """Read one whole version into the tensors of ``obj`` in place; returns its number.

    With ``newer_than`` (a version), first wait server-side for a newer one. ``strict``:
    every published tensor must be in ``obj`` (False: the others are not read).
    ``obj``'s tensors must be contiguous and on the CPU; their types may differ from
    the published ones (float types convert).
    """
    state = state_of(obj)
    published = set(sub.names())
    if strict and published - set(state):
        raise InvalidArgument(f"tensors published but not in the model: {sorted(published - set(state))[:5]}")
    into = {k: v for k, v in state.items() if k in published}
    if newer_than is not None:
        sub.wait(newer_than, timeout)
    return sub.read(into, shards={k: v for k, v in (shards or {}).items() if k in into},
                    version=version).version


def to_torch(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """The tensors of a snapshot read into new numpy arrays, as torch tensors sharing
    their memory (uint16 bit patterns become bfloat16)."""
    out = {}
    for name, arr in snapshot.tensors.items():
        if isinstance(arr, torch.Tensor):
            out[name] = arr
        elif isinstance(arr, np.ndarray) and arr.dtype == STORAGE[resolve("bfloat16")]:
            out[name] = torch.from_numpy(arr).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(np.asarray(arr))
    return out
