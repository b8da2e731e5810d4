"""The link sampler (bench/cluster/linkmon.py): a sample is timed at the middle of its
reads, and one whose reads were held up (the sampler preempted among them, on a busy
machine) is left out: its counters are not of one moment, and a rate over it came out
at several times a link's cap (tests/netns/test_testbed.py saw 3.5x)."""
from __future__ import annotations

import time

from bench.cluster import linkmon

INTERVAL = 0.02


def test_a_sample_is_timed_at_the_middle_of_its_reads():
    before = time.time()
    taken = linkmon.sample(["lo", "lo"], INTERVAL)      # the real counters of the loopback device
    after = time.time()
    assert taken is not None
    t, counters = taken
    assert before <= t <= after
    assert len(counters) == 2 and all(len(c) == 2 and min(c) >= 0 for c in counters)


def test_a_sample_whose_reads_were_held_up_is_left_out():
    def slow(port: str) -> list[int]:
        if port == "late":
            time.sleep(linkmon.MAX_READ * INTERVAL * 3)   # as a preemption between two ports' reads
        return linkmon.read("lo")
    assert linkmon.sample(["lo", "late"], INTERVAL, slow) is None
    assert linkmon.sample(["lo", "lo"], INTERVAL, slow) is not None
