"""Shared checks of published weights, run over tcp and shm here and over rdma in the
VM tier (tests/rdma/test_weights_rdma.py): contents that say their version, and one
publish/subscribe round trip with every kind of read."""
from __future__ import annotations

import threading

import numpy as np

from smb_client import Client
from smb_client.weights import Publisher, Shard, Subscriber, columns, rows
from smb_protocol.dtypes import f32_to_bf16

SHAPES = {"a": ((96, 1030), "float32"), "b": ((1000,), "int64"), "c": ((6, 10, 12), "float32"),
          "check": ((2,), "int64")}


def weights(version: int) -> dict[str, np.ndarray]:
    """Tensors whose every element depends on ``version``; ``check`` holds the version
    and a checksum of the rest."""
    a = ((np.arange(96 * 1030) % 977) + version).astype(np.float32).reshape(96, 1030)
    b = np.arange(1000, dtype=np.int64) * 3 + version
    c = (np.arange(720, dtype=np.float32) * 0.5 - version).reshape(6, 10, 12)
    return {"a": a, "b": b, "c": c, "check": np.array([version, checksum(a, b, c)], np.int64)}


def checksum(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> int:
    return int(a.astype(np.int64).sum() * 7 + b.sum() * 5 + (c * 2).astype(np.int64).sum())


def consistent(got: dict[str, np.ndarray], version: int | None = None) -> bool:
    """Every tensor of ``got`` (whole, float32) belongs to one version (``version``, if given)."""
    v = int(got["check"][0])
    if version is not None and v != version:
        return False
    if checksum(got["a"], got["b"], got["c"]) != int(got["check"][1]):
        return False
    want = weights(v)
    return all(np.array_equal(got[k], want[k]) for k in want)


def empty() -> dict[str, np.ndarray]:
    return {k: np.zeros(shape, dtype) for k, (shape, dtype) in SHAPES.items()}


def check_publish_subscribe(publisher_client: Client, reader_client: Client, name: str) -> None:
    """A reader waiting server-side is woken by a publish and reads that version whole;
    then every shard kind, a set of whole tensors and bfloat16 on read, exactly."""
    pub = Publisher.create(publisher_client, name, weights(0), versions=3)
    try:
        sub = Subscriber(reader_client, name)
        assert sub.latest() is None and sub.versions == 3
        woke: list[int] = []
        waiting = threading.Event()

        def waiter() -> None:
            waiting.set()
            woke.append(sub.wait(timeout=60))
        t = threading.Thread(target=waiter)
        t.start()
        waiting.wait(10)
        assert not woke                               # nothing published: still waiting
        pub.publish(weights(7), version=7)
        t.join(60)
        assert woke == [7]
        snap = sub.read(empty())
        assert snap.version == 7 and consistent(snap.tensors, 7)

        pub.publish(weights(9), version=9)            # the publisher's numbers, not a count
        want = weights(9)
        snap = sub.next(timeout=60)
        assert snap.version == 9 and consistent(snap.tensors, 9)

        cases = {"a": rows(1, 3), "c": Shard(1, 2, 3), "b": Shard(0, 1, 4)}
        got = sub.read(names=["a", "c", "b"], shards=cases).tensors
        for k, shard in cases.items():
            np.testing.assert_array_equal(got[k], np.array_split(want[k], shard.parts, shard.dim)[shard.index])
        for parts in (2, 3):
            for index in range(parts):
                cols = sub.read(names=["a"], shards={"a": columns(index, parts)})
                np.testing.assert_array_equal(cols.tensors["a"], np.array_split(want["a"], parts, 1)[index])
                assert sub.requests <= 4                  # not one request per row
        whole = sub.read(names=["c", "check"]).tensors
        assert set(whole) == {"c", "check"} and np.array_equal(whole["c"], want["c"])

        bf = sub.read(names=["a", "b"], shards={"a": columns(1, 2)}, dtype="bfloat16").tensors
        assert bf["a"].dtype == np.uint16 and bf["b"].dtype == np.int64    # ints are not converted
        np.testing.assert_array_equal(bf["a"], f32_to_bf16(np.array_split(want["a"], 2, 1)[1]))
        half = np.empty((6, 5, 12), np.float16)
        sub.read({"c": half}, shards={"c": Shard(1, 1, 2)})
        np.testing.assert_array_equal(half, want["c"][:, 5:].astype(np.float16))
    finally:
        pub.delete()
