"""Versioned weights from one publisher to many readers, never torn.

    from smb_client.weights import Publisher, Subscriber, Shard

    pub = Publisher.create(client, "rl/policy", state, versions=3, replicas=2)
    pub.publish(state, version=step)                 # never waits for readers

    sub = Subscriber(client, "rl/policy")
    snap = sub.next(timeout=60)                      # a server-side wait, then one whole version
    part = sub.read(names=["w"], shards={"w": Shard(dim=1, index=0, parts=2)}, dtype="bfloat16")

* :mod:`.manifest`: the regions' layout, the stamps (a seqlock per buffer); pure.
* :mod:`.shards`: tensor-parallel slices as byte runs, grouped into few requests; pure.
* :mod:`.gather`: scattered reads through a region's route, float conversion.
* :mod:`.publisher` and :mod:`.subscriber`: the two sides.

The torch wing (state dicts and models) is :mod:`smb_client.torch.weights`.
"""
from __future__ import annotations

from smb_protocol.errors import VersionGone

from .manifest import Manifest, TensorSpec
from .publisher import Publisher
from .shards import Shard, columns, rows
from .subscriber import Snapshot, Subscriber

__all__ = ["Manifest", "Publisher", "Shard", "Snapshot", "Subscriber", "TensorSpec", "VersionGone", "columns",
           "rows"]
