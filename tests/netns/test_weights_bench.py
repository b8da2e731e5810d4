"""The weights experiment, small: a trainer publishes versions to 2 readers on hosts of
their own while the same trainer broadcasts them over gloo, every reader checks every
version's checksum both ways, one reader times its shard reads (the quick version of
``python -m bench.cluster --only weights``)."""
from __future__ import annotations

import pytest

from bench.cluster import experiments, report, weights

pytestmark = pytest.mark.netns


@pytest.mark.timeout(300)
def test_published_weights_reach_every_reader_intact():
    s = experiments.quick(only=("weights",))
    lines: list[str] = []
    result = weights.run(s, lines.append)
    assert len(lines) == weights.points(s) == experiments.points(s), lines   # a line per round, one for shards
    assert result["verified"], result["rounds_seen"]                          # every checksum matched
    assert len(result["rounds_seen"]) == s.weights_warmup + s.weights_rounds
    assert result["hosts"]["readers"] == ["wrk1", "wrk2"] and result["hosts"]["trainer"] == "wrk0"
    for key in ("publish_to_all_hold_s", "publish_acked_s", "broadcast_s"):
        assert result[key] > 0, (key, result)
    # the readers start once the version is complete: never before the acknowledgement
    assert result["publish_to_all_hold_s"] >= result["publish_acked_s"]
    shards = result["shards_s"]
    assert set(shards) == {"full read", "row shard", "column shard"}
    # links are the limit: half the bytes of a row shard take well under the full read's time
    assert shards["row shard"] < 0.8 * shards["full read"], shards
    md = report.markdown({"settings": {"cap_mbit": s.cap_mbit}, "weights": result})
    assert "| publish -> all 2 readers hold |" in md and "| row shard (2-way), one reader |" in md
    assert report.targets({"weights": result})[0].startswith("weights: publish -> all hold")
