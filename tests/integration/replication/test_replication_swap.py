"""A graceful handover on the memory-server side (``smb_server/memserver/replication.py``):
the old primary is made a backup first, which drains its forwarding, so the copies that
stay need no copy, and a role swap keeps the old primary as a backup of the new one.
The test plays the controller and a client that follows NotPrimary to the other copy
with the same request number, as the client library does."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from smb_protocol.errors import NotPrimary, ServerUnavailable

from .nodes import SIZE, Client
from .test_replication_server import accumulate_in_background, replica_set

FOLLOW = 50   # times a request follows NotPrimary to the other copy before the test gives up


def swap(old, new, view: int, others=()) -> int:
    """The controller's graceful swap from ``old`` to ``new``: drain ``old`` (a backup
    at ``view + 1``), then at ``view + 2`` the backups first, the new primary last, its
    backups live (no sync). Returns the view in force."""
    old.configure(view + 1, "backup")
    for b in (old, *others):
        b.configure(view + 2, "backup")
    new.configure(view + 2, "primary", [old, *others])
    return view + 2


def test_role_swaps_under_accumulates_leave_identical_exact_copies(nodes):
    """Accumulates of several forwarding pieces each run while the primary's role moves
    back and forth: a request cut by a swap resumes at the new primary, which forwards
    its rest to the old one, now a backup; no copy is made and every copy ends exact."""
    a, b, c = replica_set(nodes, 3)
    client = Client(a)
    done: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    switched = 0

    def accumulate() -> None:
        nonlocal switched
        ones = np.ones(SIZE // 8, np.int64)
        try:
            while not stop.is_set():
                seq = next(client.seqs)
                for _ in range(FOLLOW):
                    try:
                        client.accumulate(0, ones, seq=seq)
                        break
                    except NotPrimary:   # follow the swap with the same number
                        switched += 1
                        client.session.close()
                        client.session = client.open(b if client.node is a else a)
                else:
                    raise AssertionError(f"request {seq} refused {FOLLOW} times by both copies")
                done.append(seq)
        except BaseException as exc:   # reported below
            failures.append(exc)
    t = threading.Thread(target=accumulate)
    t.start()
    view, head = 1, a
    try:
        for _ in range(12):
            start = len(done)
            deadline = time.monotonic() + 60
            while len(done) < start + 1 and not failures:   # at least one request per view
                assert time.monotonic() < deadline, "no request completes"
                t.join(0.01)
            other = b if head is a else a
            view = swap(head, other, view, [c])
            head = other
    finally:
        stop.set()
        t.join(120)
    assert not failures, failures
    assert a.data() == b.data() == c.data()
    np.testing.assert_array_equal(a.array(np.int64), len(done))
    assert switched and a.repl.counts["sync_bytes"] == b.repl.counts["sync_bytes"] == 0
    client.close()


def test_a_primary_with_a_failed_backup_is_demoted_but_says_that_copy_missed_mutations(nodes):
    primary, backup = replica_set(nodes)
    backup.tcp.close()                                  # the backup misses a piece
    client = Client(primary)
    done, result = accumulate_in_background(client)
    while not primary.repl.failed_backups():
        assert not done.wait(0.01), result
    with pytest.raises(ServerUnavailable, match=f"backup {backup.eid} .*failed.*copy it again"):
        primary.configure(2, "backup")
    assert primary.repl.role(primary.eid) == "backup"   # the demotion holds: it is drained
    assert done.wait(10) and isinstance(result[0], NotPrimary)   # its waiting request is refused
    assert primary.configure(2, "backup").view == 2     # a repeat succeeds
    client.close()
