"""Thousands of collective rounds with random windows, chunk sizes, buffer lengths and
delays, each party a client of its own in a thread, against the shared local cluster:
every sum exact, no error at all (no answer to a request not in flight, no timeout),
and the region deleted only once every party has its last sum."""
from __future__ import annotations

import random
import threading
import time

import numpy as np

from smb_client.collective import Collective
from smb_server.testing import run_ranks

KiB = 1 << 10
PARTIES = 3
CONFIGS = 8
ROUNDS = 250          # per configuration: 2000 rounds in all


def test_thousands_of_rounds_with_random_windows_chunks_and_delays(cluster, name):
    plan = random.Random(20261127)
    for config in range(CONFIGS):
        chunk = plan.choice([4 * KiB, 8 * KiB, 16 * KiB, 64 * KiB])
        nbytes = chunk * plan.randint(2, 12)
        window = chunk * plan.randint(1, 6)
        priority = plan.random() < 0.5
        lengths = [plan.randint(1, nbytes // 8) for _ in range(ROUNDS)]      # int64 elements per round
        _run(cluster, f"{name}-{config}", nbytes, chunk, window, priority, lengths, seed=config)


def _run(cluster, name: str, nbytes: int, chunk: int, window: int, priority: bool,
         lengths: list[int], seed: int) -> None:
    clients = [cluster.client() for _ in range(PARTIES)]
    created = threading.Event()

    def party(rank: int) -> None:
        delays = random.Random(seed * 100 + rank)
        if rank == 0:
            coll = Collective.create(clients[0], name, nbytes, PARTIES, chunk_bytes=chunk, timeout=60,
                                     window=window, priority=priority)
            created.set()
        else:
            assert created.wait(30)
            coll = Collective.open(clients[rank], name, PARTIES, timeout=60, window=window, priority=priority)
        with coll:
            for k, n in enumerate(lengths):
                if delays.random() < 0.1:
                    time.sleep(delays.random() * 0.002)      # the scenario: a party a little late
                x = np.arange(n, dtype=np.int64) * (rank + 1) + k
                coll.all_reduce(x)
                want = np.arange(n, dtype=np.int64) * (PARTIES * (PARTIES + 1) // 2) + k * PARTIES
                if not np.array_equal(x, want):
                    raise AssertionError(f"rank {rank}, round {k}: wrong sum")
    try:
        run_ranks(PARTIES, party, timeout=300)       # every party has its last sum before the delete
    finally:
        clients[0].delete_region(name)
        for c in clients:
            c.close()
