"""The elastic-pool benchmark's evacuation, small: 2 SyncDataParallel workers on the
testbed, a spare server joins, the memory server holding the most of the job's bytes is
evacuated mid-run, removed and stopped; training goes on, every copy is identical
afterwards and the stored weights equal the workers' byte for byte (the short version
of ``python -m bench.elastic``)."""
from __future__ import annotations

import pytest

from bench import elastic

pytestmark = pytest.mark.netns


@pytest.mark.timeout(180)
def test_an_evacuation_under_synchronous_training_loses_nothing():
    s = elastic.settings_from(elastic.parse_args(["--quick", "--schemes", "sync", "--epochs", "20",
                                                  "--hidden", "64"]))
    s = elastic.replace(s, runs=("evacuate",))
    result = elastic.run_scheme(s, "sync", lambda message: None)
    summary = result["evacuate"]["summary"]
    assert summary["ok"], summary["error"]                      # no worker failed
    move = summary["move"]
    assert move["seconds"] is not None and move["bytes_moved"] > 0, move
    assert move["removed"] == move["source"]["server"], move    # then left the pool
    assert move["source"]["host"] not in move["job_bytes_after"], move
    check = summary["check"]
    assert check["copies_identical"] and check["copies_differing_bytes"] == 0, check
    assert check["weights_ok"], check["weights"]                # stored weights == every worker's
    assert "lost" not in check["states_seen"] and set(check["states_end"].values()) == {"ready"}, check
    assert summary["bytes_lost"] == 0
    assert summary["steps_per_second"].get("after"), summary["steps_per_second"]   # training went on after it
