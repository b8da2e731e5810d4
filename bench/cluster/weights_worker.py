"""The weights experiment's worker (mode ``weights``), run by :mod:`.worker` inside a
worker host's namespace; see :mod:`.weights`.

Rank 0 is the trainer, ranks 1.. the readers; all of them are also one gloo group
(``spec["master"]``: the trainer's host). Every round ``r``:

1. the trainer makes version ``r``'s contents (:func:`bench.weights_measure.set_version`)
   and sends its CRC-32 to the readers (a gloo ``broadcast_object_list``); a gloo barrier;
2. the trainer ``publish``es version ``r`` (start and acknowledgement times); every
   reader waits for it server-side (``Subscriber.next``) into its own arrays, notes when
   it held it, and checks the CRC of what it holds;
3. the readers clear their arrays (NaN); a gloo barrier; the trainer broadcasts the same
   tensors over gloo into the readers' arrays (:func:`bench.weights_measure.broadcast_all`),
   and every reader checks the CRC again;
4. every rank's times and checks are gathered on the trainer, which appends the round's
   figures to ``progress.jsonl`` in ``spec["signal_dir"]`` (the experiment prints them).

Then reader 1 times its full read against its 2-way row and column shard reads of the
last version (:func:`bench.weights_measure.time_reads`), each read compared element for
element with the version, and the trainer deletes the publication. Times are
``CLOCK_MONOTONIC`` seconds (one clock for every namespace of the machine).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from bench.weights_measure import base, broadcast_all, checksum, now, set_version, state, time_reads

log = logging.getLogger(__name__)

WAIT_TIMEOUT = 600.0    # seconds a reader waits for a version
TRAINER, SHARD_READER = 0, 1


def _progress(spec: dict[str, Any], doc: dict[str, Any]) -> None:
    """Append one line to the experiment's progress file (the trainer only writes it)."""
    with open(Path(spec["signal_dir"]) / "progress.jsonl", "a") as f:
        f.write(json.dumps(doc) + "\n")


def round_figures(rank_docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's figures from every rank's record of it (the trainer's first): seconds
    from the publish's start until the last reader held the version, until the publish
    was acknowledged, and of the gloo broadcast until the last rank had it; whether every
    reader's checksums matched."""
    trainer, readers = rank_docs[0], rank_docs[1:]
    return {"round": trainer["round"], "version": trainer["version"],
            "publish_to_all_hold": max(d["held"] for d in readers) - trainer["publish_start"],
            "publish_acked": trainer["publish_acked"] - trainer["publish_start"],
            "broadcast": max(d["broadcast_end"] for d in rank_docs) - trainer["broadcast_start"],
            "verified": all(d["publish_ok"] and d["broadcast_ok"] for d in readers)}


def weights(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the experiment (``spec``: rank, world, mb, rounds, warmup, name,
    servers, versions, master, master_port, signal_dir, controller)."""
    import torch
    import torch.distributed as dist

    from smb_client import Client
    from smb_client.weights import Publisher, Subscriber

    from .training_worker import init_gloo
    rank, mb, name = spec["rank"], spec["mb"], spec["name"]
    total = spec["warmup"] + spec["rounds"]
    init_gloo(spec)
    out: dict[str, Any] = {"rank": rank, "rounds": []}
    try:
        with Client(spec["controller"], os.environ.get("SMB_TOKEN", "")) as c:
            arrays = state(mb)
            tensors = [torch.from_numpy(a) for a in arrays.values()]
            start = base(mb) if rank == TRAINER else {}
            pub = sub = None
            if rank == TRAINER:
                pub = Publisher.create(c, name, arrays, versions=spec["versions"], num_servers=spec["servers"])
            dist.barrier()
            if rank != TRAINER:
                sub = Subscriber(c, name)
            try:
                for r in range(total):
                    doc: dict[str, Any] = {"round": r, "version": r}
                    if pub is not None:
                        set_version(arrays, start, r)
                    note = [r, checksum(arrays) if pub is not None else 0]
                    dist.broadcast_object_list(note, TRAINER)
                    version, crc = note
                    dist.barrier()
                    if pub is not None:
                        doc["publish_start"] = now()
                        pub.publish(arrays, version=version)
                        doc["publish_acked"] = now()
                    else:
                        assert sub is not None
                        snap = sub.next(arrays, timeout=WAIT_TIMEOUT)
                        doc["held"] = now()
                        doc["publish_ok"] = snap.version == version and checksum(arrays) == crc
                        for a in arrays.values():
                            a.fill(np.nan)
                    dist.barrier()
                    doc["broadcast_start"], doc["broadcast_end"] = broadcast_all(tensors, TRAINER)
                    if pub is None:
                        doc["broadcast_ok"] = checksum(arrays) == crc
                    docs: list[Any] = [None] * dist.get_world_size()
                    dist.all_gather_object(docs, doc)
                    out["rounds"].append(doc)
                    if pub is not None:
                        figures = round_figures(docs)
                        out.setdefault("figures", []).append(figures)
                        _progress(spec, {"kind": "round", "warmup": r < spec["warmup"], **figures})
                shards: list[Any] = [None]
                if rank == SHARD_READER:
                    expect = {k: a.copy() for k, a in arrays.items()}   # the last version, checked above
                    shards[0] = time_reads(sub, mb, spec["rounds"], full=arrays, expect=expect)
                    out["shards"] = shards[0]
                dist.broadcast_object_list(shards, SHARD_READER)
                if pub is not None:
                    _progress(spec, {"kind": "shards", **shards[0]})
                dist.barrier()
            finally:
                if pub is not None:
                    pub.delete()
    finally:
        dist.destroy_process_group()
    return out


MODES = {"weights": weights}
