"""SEASGD training on the testbed with the store on replicas=2 while the memory server
holding a primary of the counters and of the weights is killed with SIGKILL: training
goes on without a restart, every copy is identical afterwards, nothing was lost or
applied twice (the quick version of ``python -m bench.cluster --only replication``)."""
from __future__ import annotations

import pytest

from bench.cluster import experiments, replica_failure

pytestmark = pytest.mark.netns


@pytest.mark.timeout(400)
def test_training_survives_a_killed_memory_server():
    result = replica_failure.run(experiments.quick(), lambda message: None)
    summary = result["summary"]
    assert summary["undisturbed"]["ok"] and summary["kill"]["ok"], summary   # no worker failed
    failure = summary["failure"]
    assert failure["killed_server"], failure
    assert failure["promotions"], failure                   # a backup took over
    assert failure["first_op_at_new_primary_after"] is not None, failure
    assert failure["ready_after"] is not None, failure      # repaired: every region ready again
    assert failure["copies_identical"] and failure["copies_differing_bytes"] == 0, failure
    assert failure["counters_consistent"], failure          # no step counted twice or lost
    assert failure["bytes_lost"] == 0, failure              # weights = initial + every pushed delta
    # the same accuracy as the undisturbed run, within what SEASGD's asynchrony allows
    assert abs(summary["kill"]["accuracy"] - summary["undisturbed"]["accuracy"]) <= 0.05, summary
