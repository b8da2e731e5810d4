import threading
import time
from collections import OrderedDict

import pytest

from smb_protocol.errors import InvalidArgument
from smb_protocol.wire import Op
from smb_server.memserver.dedup import DedupTable, pack_records, unpack_records


def test_duplicate_gets_the_first_answer():
    t = DedupTable()
    first, e = t.begin(7, 1)
    assert first
    e.finish(0, b"old-value")
    again, e2 = t.begin(7, 1)
    assert not again and e2.body == b"old-value" and e2.status == 0


def test_retry_waits_for_the_running_attempt():
    t = DedupTable()
    _, e = t.begin(1, 5)
    got = []

    def retry():
        got.append(t.begin(1, 5))
    th = threading.Thread(target=retry)
    th.start()
    time.sleep(0.2)
    assert not got            # still waiting: never runs concurrently with the first
    e.finish(0, b"x")
    th.join(2)
    assert got and got[0][0] is False and got[0][1].body == b"x"


def test_running_attempt_times_out_the_waiter():
    t = DedupTable()
    t.begin(1, 5)
    with pytest.raises(TimeoutError):
        t.begin(1, 5, timeout=0.05)


def test_interrupted_attempt_is_resumed_by_the_retry():
    t = DedupTable()
    _, e = t.begin(1, 9)
    e.applied = 4096
    t.interrupt(e)
    first, e2 = t.begin(1, 9)
    assert first and e2 is e and e2.applied == 4096


def test_window_is_bounded():
    t = DedupTable(window=3)
    for seq in range(1, 11):
        t.begin(1, seq)[1].finish()
    assert len(t) == 3
    assert t.begin(1, 10)[0] is False     # recent: remembered
    assert t.begin(1, 1)[0] is True       # old: forgotten


def test_a_full_window_forgets_its_oldest_entry_without_looking_at_the_rest():
    """Once a client's window is full, each new request forgets one entry: the oldest
    finished one, found from the front, not by listing the whole window under the
    table's lock (which cost ~0.9 ms per request at the default window of 4096, for
    every client of the server; found by the soak, bench/soak.py)."""
    visited = 0

    class Counting(OrderedDict):
        def items(self):
            nonlocal visited
            for item in super().items():
                visited += 1
                yield item

    window = 1000
    t = DedupTable(window=window)
    t._clients[1] = Counting()
    running = t.begin(1, 1)[1]                # the oldest entry still runs: it is kept
    for seq in range(2, window + 1):
        t.begin(1, seq)[1].finish()
    visited = 0
    for seq in range(window + 1, 3 * window + 1):
        t.begin(1, seq)[1].finish()
    assert len(t) == window
    assert visited <= 3 * 2 * window, visited   # a few entries per request, not the window
    assert t.begin(1, 3 * window)[0] is False     # the newest: remembered
    assert t.begin(1, 2 * window + 2)[0] is False  # the oldest finished one still in the window
    assert t.begin(1, 2 * window + 1)[0] is True   # one older: forgotten
    running.finish()
    assert t.begin(1, 1)[0] is False              # the running one was never dropped


def test_clients_are_independent():
    t = DedupTable()
    t.begin(1, 1)[1].finish(0, b"a")
    first, e = t.begin(2, 1)
    assert first
    e.finish(0, b"b")
    assert t.begin(1, 1)[1].body == b"a"
    assert t.begin(2, 1)[1].body == b"b"


def test_clients_are_bounded():
    t = DedupTable(max_clients=2)
    for c in (1, 2, 3):
        t.begin(c, 1)[1].finish()
    assert t.begin(1, 1)[0] is True       # least recently seen client forgotten


def test_a_number_reused_for_another_request_is_refused():
    t = DedupTable()
    _, e = t.begin(3, 9, what=(4, 1, 0, 64))
    e.finish()
    with pytest.raises(ValueError, match="names one request"):
        t.begin(3, 9, what=(4, 1, 64, 64))
    again, _ = t.begin(3, 9, what=(4, 1, 0, 64))
    assert not again


def test_entries_of_an_extent_are_handed_over_and_taken_where_absent():
    src = DedupTable()
    what = (4, 100, 0, 64, 3)
    _, done = src.begin(1, 10, what=what)
    done.applied = 64
    done.finish(0, b"")
    _, word = src.begin(1, 11, what=(7, 100, 8, 8, 0))
    word.applied = 8
    word.finish(0, b"\x01" + b"\x00" * 7)
    _, cut = src.begin(2, 5, what=(4, 100, 0, 4096, 3))
    cut.applied = 1024
    src.interrupt(cut)                        # interrupted after 1 KiB
    _, running = src.begin(2, 6, what=(4, 100, 0, 64, 3))   # still running: its pieces follow
    src.begin(3, 1, what=(4, 200, 0, 64, 3))  # another extent
    records = src.export(100)
    assert sorted((r[0], r[1]) for r in records) == [(1, 10), (1, 11), (2, 5)]
    dst = DedupTable()
    _, own = dst.begin(1, 11, what=(7, 100, 8, 8, 0))   # came as a forwarded piece: kept
    (message,) = pack_records(records)
    assert dst.seed(unpack_records(message)) == 2
    fresh, entry = dst.begin(1, 10, what=what)
    assert not fresh and entry.status == 0                    # answered, not run again
    fresh, entry = dst.begin(2, 5, what=(4, 100, 0, 4096, 3))
    assert fresh and entry.applied == 1024                    # resumed after what took effect
    assert not own.done                                       # the table's own entry untouched


def test_handed_over_bytes_that_are_not_records_are_refused():
    (data,) = pack_records([(1, 2, (4, 100, 0, 64, 3), 64, True, 0, b"answer")])
    assert len(list(unpack_records(data))) == 1
    for bad in (data[:-1], data + b"\x00"):
        with pytest.raises(InvalidArgument):
            list(unpack_records(bad))


def test_records_are_packed_into_messages_of_whole_records_under_the_limit():
    records = [(7, seq, (7, 100, 8 * seq, 8, 0), 8, True, 0, bytes(8)) for seq in range(1, 201)]
    messages = pack_records(records, limit=1000)
    assert len(messages) > 1 and all(len(m) <= 1000 for m in messages)
    assert [r for m in messages for r in unpack_records(m)] == records


def test_a_collective_chunks_entry_is_handed_over_with_its_count_words_offset():
    """A push's entry is filed with its count word's extent offset where other requests
    have a dtype code: a copy filled by a move gets it whole (the record once held a byte)."""
    record = (5, 9, (int(Op.REDUCE), 100, 0, 4096, 1 << 21), 4096, True, 0, bytes(8))
    (message,) = pack_records([record])
    assert list(unpack_records(message)) == [record]


def test_a_copy_synced_again_forgets_the_entries_of_its_extent_only():
    table = DedupTable()
    acc = (int(Op.ACCUMULATE), 7, 0, 64, 1)
    other = (int(Op.ACCUMULATE), 8, 0, 64, 1)
    for seq, what in ((1, acc), (2, other)):
        _, entry = table.begin(0xA, seq, what=what)
        entry.finish(0, b"")
    _, running = table.begin(0xA, 3, what=acc)       # an older view's piece, still streaming in
    assert table.forget(7) == 2
    assert table.begin(0xA, 1, what=acc)[0]          # fresh again: the next piece is applied
    assert not table.begin(0xA, 2, what=other)[0]    # another extent's entry is kept
    running.finish(0, b"")                           # the old piece ends: its entry is gone
    assert table.begin(0xA, 3, what=acc)[0]
