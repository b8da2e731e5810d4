"""The ``smb`` process group restarted on the store of a dead attempt (torchrun keeps its
c10d store across ``--max-restarts``): every attempt has keys of its own in the store,
so a restarted rank never reads the dead attempt's prefix or collectives, and the new
attempt's sums are exact. Ranks are threads of this process sharing one c10d store."""
from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from smb_client.torch.backend import SMBProcessGroup  # noqa: E402
from smb_server.testing import run_ranks  # noqa: E402

WORLD = 2


def _group(cluster, store, rank: int, attempt: int, seconds: float = 30.0) -> SMBProcessGroup:
    return SMBProcessGroup(store, rank, WORLD, datetime.timedelta(seconds=seconds), client=cluster.client(),
                           attempt=attempt)


def _sum_once(groups: list[SMBProcessGroup], k: int) -> list[np.ndarray]:
    def rank(r: int) -> np.ndarray:
        x = np.arange(1000, dtype=np.int64) * (r + 1) + k
        return groups[r].collective(x.nbytes).all_reduce(x)
    return run_ranks(WORLD, rank, timeout=60)


def test_a_restarted_attempt_gets_keys_and_regions_of_its_own(cluster):
    store = torch.distributed.HashStore()
    first = [None, None]
    first[0] = _group(cluster, store, 0, attempt=0)
    first[1] = _group(cluster, store, 1, attempt=0)
    want = np.arange(1000, dtype=np.int64) * 3
    for got in _sum_once(first, 0):
        np.testing.assert_array_equal(got, want)
    # rank 1 dies (its group is never shut down); torchrun restarts both on the same store.
    # The restarted rank 1 waits for the new attempt's rank 0: alone, it gets nothing.
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        _group(cluster, store, 1, attempt=1, seconds=1.0)
    second: list[SMBProcessGroup | None] = [None, None]
    late = threading.Thread(target=lambda: second.__setitem__(1, _group(cluster, store, 1, attempt=1)))
    late.start()
    second[0] = _group(cluster, store, 0, attempt=1)
    late.join(30)
    assert second[1] is not None and second[0].prefix == second[1].prefix != first[0].prefix
    for got in _sum_once(second, 5):
        np.testing.assert_array_equal(got, want + 10)
    for group in (second[1], second[0], first[1], first[0]):   # rank 0 last: it waits for the others
        group.shutdown()
