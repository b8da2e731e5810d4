"""The weights experiment's figures (bench/cluster/weights_worker.py, weights.py) from
what each rank recorded, and what the shared measuring module checks: a version's
contents differ from every other version's, element for element, and so does its
checksum; a read that differs from the version published fails."""
from __future__ import annotations

import numpy as np
import pytest

from bench.cluster import weights, weights_worker
from bench.weights_measure import base, checksum, set_version, shapes, state, time_reads


def test_a_round_is_timed_from_the_publish_to_the_last_reader():
    trainer = {"round": 1, "version": 1, "publish_start": 10.0, "publish_acked": 11.0,
               "broadcast_start": 20.0, "broadcast_end": 20.5}
    readers = [{"held": 12.0, "publish_ok": True, "broadcast_end": 23.0, "broadcast_ok": True},
               {"held": 13.5, "publish_ok": True, "broadcast_end": 22.0, "broadcast_ok": True}]
    f = weights_worker.round_figures([trainer, *readers])
    assert (f["publish_to_all_hold"], f["publish_acked"], f["broadcast"], f["verified"]) == (3.5, 1.0, 3.0, True)
    readers[1]["broadcast_ok"] = False
    assert not weights_worker.round_figures([trainer, *readers])["verified"]


def test_the_report_states_the_targets():
    r = {"readers": 8, "servers": 4, "mb": 256, "bytes": 256 << 20, "versions": 3, "rounds": 3, "warmup": 1,
         "publish_to_all_hold_s": 10.0, "publish_acked_s": 4.0, "broadcast_s": 25.0, "verified": True,
         "shards_s": {"full read": 4.0, "row shard": 2.1, "column shard": 4.0},
         "link_bound_seconds": {"publish_to_all_hold": 12.9, "full_read": 4.3}}
    assert "| publish -> all 8 readers hold | 10.000 | gloo broadcast to the same readers | 25.000 | 0.40 |" \
        in weights.table(r)
    (line,) = weights.targets(r)
    assert "2.50x faster" in line and "0.53 of the full read" in line and "NOT met" not in line
    r["verified"] = False
    assert "checksums: DIFFER" in weights.targets(r)[0] and "DID NOT match" in weights.summary(r)


def test_every_version_has_contents_and_a_checksum_of_its_own():
    start, a = base(1), state(1)
    sums = []
    for v in range(3):
        set_version(a, start, v)
        assert all(np.all(a[k] == start[k] + np.float32(v)) for k in a)
        sums.append(checksum(a))
    assert len(set(sums)) == 3
    set_version(a, start, 1)
    assert checksum(a) == sums[1]


class _Reader:
    """Stands in for a Subscriber: fills every destination from ``data``, wrong where told."""

    def __init__(self, data: dict[str, np.ndarray], wrong: str = "") -> None:
        self.data, self.wrong = data, wrong

    def read(self, into: dict[str, np.ndarray], shards: dict) -> None:
        for k, out in into.items():
            src = self.data[k]
            if k in shards:
                lo, hi = shards[k].bounds(src.shape[shards[k].dim])
                src = src[lo:hi] if shards[k].dim == 0 else src[:, lo:hi]
            out[...] = src
            if k == self.wrong:
                out.flat[-1] += 1


def test_shard_reads_are_checked_against_the_version():
    data = base(1)
    assert [k for k in shapes(1)] == list(data)
    times = time_reads(_Reader(data), 1, 2, expect=data)
    assert set(times) == {"full read", "row shard", "column shard"}
    with pytest.raises(AssertionError, match="differs from the version published"):
        time_reads(_Reader(data, wrong="layer0.weight"), 1, 1, expect=data)
