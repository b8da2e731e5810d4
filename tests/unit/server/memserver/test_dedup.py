import ctypes
import threading
import time

import pytest

from smb_protocol.errors import InvalidArgument
from smb_protocol.wire import Op
from smb_server.memserver import _native
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
    every client of the server; found by the soak, bench/soak.py). The native table
    counts the entries its trims look at (``_trim_visits``)."""
    window = 1000
    t = DedupTable(window=window)
    running = t.begin(1, 1)[1]                # the oldest entry still runs: it is kept
    for seq in range(2, window + 1):
        t.begin(1, seq)[1].finish()
    before = t._trim_visits
    for seq in range(window + 1, 3 * window + 1):
        t.begin(1, seq)[1].finish()
    visited = t._trim_visits - before
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


# ---- the native table (smb_server/memserver/native/dedup.c) ----------------------

def test_a_running_entry_forgotten_by_its_extent_stays_readable_and_finishing_it_is_harmless():
    t = DedupTable()
    what = (int(Op.ACCUMULATE), 7, 0, 64, 1)
    _, e = t.begin(0xA, 1, what=what)
    e.applied = 32
    e.body = b"partial"
    assert t.forget(7) == 1 and len(t) == 0
    assert e.owned and not e.done and e.applied == 32 and e.body == b"partial" and e.what == what
    e.finish(0, b"late")                              # on an entry no table holds: harmless
    assert e.done and e.body == b"late" and len(t) == 0
    fresh, again = t.begin(0xA, 1, what=what)         # a new attempt, a new entry
    assert fresh and again is not e and again.applied == 0


def test_an_entry_of_a_forgotten_client_outlives_the_table():
    t = DedupTable(max_clients=1)
    _, e = t.begin(1, 1, what=(1, 2))
    t.begin(2, 1)                                     # client 1 forgotten, its entry running
    assert len(t) == 1
    del t                                             # the entry keeps its table alive
    e.finish(3, b"x")
    assert e.done and e.status == 3 and e.body == b"x"


def test_the_same_entry_is_the_same_object_while_it_lives():
    t = DedupTable()
    _, e = t.begin(1, 1)
    e.finish(0, b"a")
    assert t.begin(1, 1)[1] is e
    del e                                             # its face goes; the entry stays filed
    again = t.begin(1, 1)[1]
    assert again.body == b"a" and not again.owned     # a new face over the same entry
    assert again is t.begin(1, 1)[1]


def test_the_first_answer_stays():
    t = DedupTable()
    _, e = t.begin(1, 1)
    e.finish(0, b"first")
    e.finish(5, b"second")                            # ignored: repeats were answered already
    assert (e.status, e.body) == (0, b"first")
    with pytest.raises(AttributeError):
        e.body = b"other"
    assert t.begin(1, 1)[1].body == b"first"


def test_many_clients_beyond_max_clients_forget_the_least_recently_seen():
    t = DedupTable(window=4, max_clients=100)
    for c in range(1, 1001):
        for seq in (1, 2):
            t.begin(c, seq)[1].finish(0, c.to_bytes(2, "little"))
        if c > 1 and c % 10 == 0:
            t.begin(1, 1)                              # client 1 seen again and again: kept
    assert len(t) == 100 * 2
    assert t.begin(1, 1)[0] is False
    assert all(t.begin(c, 2)[1].body == c.to_bytes(2, "little") for c in range(902, 1001))
    assert t.begin(500, 1)[0] is True                  # long forgotten: comes back as new,
    assert len(t) == 100 * 2 - 2 + 1                   # and the least recently seen (1) goes
    assert t.begin(1, 2)[0] is True


def test_the_window_keeps_running_and_interrupted_entries():
    t = DedupTable(window=3)
    running = [t.begin(1, seq)[1] for seq in (1, 2)]
    _, cut = t.begin(1, 3)
    cut.applied = 10
    t.interrupt(cut)
    for seq in range(4, 20):
        t.begin(1, seq)[1].finish()
    assert len(t) == 3 + 1                             # three kept beyond the window, one finished
    assert t.begin(1, 3) == (True, cut) and cut.applied == 10
    assert t.begin(1, 19)[0] is False and t.begin(1, 18)[0] is True
    for e in running:
        e.finish()


def test_client_and_seq_are_unsigned_64_bit():
    t = DedupTable()
    top = 2**64 - 1
    _, e = t.begin(top, top, what=(-(2**63), 2**63 - 1))
    e.finish(0, b"z")
    assert t.begin(top, top, what=(-(2**63), 2**63 - 1))[1].body == b"z"
    assert t.begin(top, 0)[0] and t.begin(0, top)[0]
    for bad in (-1, 2**64):
        with pytest.raises(OverflowError):
            t.begin(bad, 1)
        with pytest.raises(OverflowError):
            t.begin(1, bad)
    with pytest.raises(OverflowError):
        t.begin(1, 1, what=(2**63,))
    _, r = t.begin(top, 5)
    with pytest.raises(TimeoutError, match=f"request 5 of client {top:#x} is still running"):
        t.begin(top, 5, timeout=0.01)
    with pytest.raises(ValueError, match=r"request 5 of client 0xf+ was \(\), now \(1, 2\): "):
        t.begin(top, 5, what=(1, 2))
    r.finish()


def test_concurrent_begins_make_exactly_one_owner_per_number():
    t = DedupTable()                                  # a window that holds them all
    threads = 8
    owners: list[tuple[int, int]] = []
    answers: list[bytes] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(i: int) -> None:
        start.wait()
        for seq in range(1, 201):
            # seqs 1..200 shared by everyone; seq + 1000 * (i + 1) this thread's own
            for s in (seq, seq + 1000 * (i + 1)):
                fresh, e = t.begin(7, s, timeout=10)
                if fresh:
                    with lock:
                        owners.append((s, i))
                    e.finish(0, s.to_bytes(4, "little"))
                else:
                    with lock:
                        answers.append(e.body)
                    assert e.body == s.to_bytes(4, "little")
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(30)
    shared = [s for s, _ in owners if s <= 200]
    own = [s for s, _ in owners if s > 200]
    assert sorted(shared) == list(range(1, 201))            # each shared number ran once
    assert len(own) == len(set(own)) == threads * 200       # each own number ran, once
    assert len(answers) == (threads - 1) * 200


def test_a_waiting_begin_lets_other_python_threads_run():
    t = DedupTable()
    t.begin(1, 5)                                     # running, never finished
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            t.begin(1, 5, timeout=0.6)
        except TimeoutError as exc:
            waited.append(exc)
    th = threading.Thread(target=wait)
    gap, n = 0.0, 0
    th.start()
    last = end = time.monotonic()
    end = last + 0.4
    while (now := time.monotonic()) < end:            # Python work while the other waits
        gap, last, n = max(gap, now - last), now, n + 1
    th.join(5)
    assert waited and n > 1000
    assert gap < 0.2, gap                             # never stopped for the wait


def test_a_wait_wakes_on_an_interrupt_and_resumes():
    t = DedupTable()
    _, e = t.begin(1, 5)
    got = []
    th = threading.Thread(target=lambda: got.append(t.begin(1, 5, timeout=5)))
    th.start()
    time.sleep(0.1)
    e.applied = 3
    t.interrupt(e)
    th.join(5)
    assert got == [(True, e)] and e.owned and e.applied == 3


def _c_api() -> tuple[ctypes.CDLL, ctypes.PyDLL]:
    """native.h's table API, called through ctypes: a CDLL call gives up the interpreter
    lock, as the native request loop runs."""
    lib, pylib = ctypes.CDLL(_native.__file__), ctypes.PyDLL(_native.__file__)
    vp, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
    pylib.dd_table_of.argtypes, pylib.dd_table_of.restype = [ctypes.py_object], vp
    lib.dd_begin.argtypes = [vp, u64, u64, ctypes.POINTER(i64), ctypes.c_int, ctypes.c_double, ctypes.POINTER(vp)]
    lib.dd_finish.argtypes = [vp, vp, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.dd_interrupt.argtypes = [vp, vp]
    lib.dd_entry_decref.argtypes = lib.dd_entry_incref.argtypes = [vp]
    for name in ("dd_entry_owned", "dd_entry_done", "dd_entry_status"):
        getattr(lib, name).argtypes = [vp]
    lib.dd_entry_applied.argtypes, lib.dd_entry_applied.restype = [vp], i64
    lib.dd_entry_set_applied.argtypes = [vp, i64]
    lib.dd_entry_body.argtypes, lib.dd_entry_body.restype = [vp, ctypes.POINTER(ctypes.c_size_t)], vp
    lib.dd_entry_what.argtypes = [vp, ctypes.POINTER(i64)]
    return lib, pylib


def test_c_callers_share_the_table_with_python_callers():
    lib, pylib = _c_api()
    t = DedupTable()
    table = pylib.dd_table_of(t)
    with pytest.raises(TypeError):
        pylib.dd_table_of(object())
    what = (ctypes.c_int64 * 5)(4, 100, 0, 64, 3)
    out = ctypes.c_void_p()

    def c_begin(seq: int, timeout: float) -> int:
        return lib.dd_begin(table, 9, seq, what, 5, timeout, ctypes.byref(out))

    # a C owner; a Python repeat waits for it (without the interpreter lock: the C
    # caller below needs none) and gets its answer
    assert c_begin(1, 0) == 1
    owner = out.value
    lib.dd_entry_set_applied(owner, 64)
    assert c_begin(1, 0) == -1 and out.value is None             # another attempt runs
    got = []
    th = threading.Thread(target=lambda: got.append(t.begin(9, 1, timeout=5, what=tuple(what))))
    th.start()
    time.sleep(0.1)
    assert lib.dd_finish(table, owner, 0, b"answer", 6) == 0
    assert lib.dd_finish(table, owner, 1, b"again", 5) == 1      # the first answer stays
    th.join(5)
    (fresh, e), = got
    assert not fresh and e.body == b"answer" and e.applied == 64 and e.status == 0
    lib.dd_entry_decref(owner)
    # a Python owner; a C repeat waits in another thread for its finish
    fresh, e = t.begin(9, 2, what=tuple(what))
    codes = []
    th = threading.Thread(target=lambda: codes.append(c_begin(2, 5.0)))
    th.start()
    time.sleep(0.1)
    assert not codes
    e.finish(7, b"py")
    th.join(5)
    assert codes == [0]
    n = ctypes.c_size_t()
    assert lib.dd_entry_done(out.value) == 1 and lib.dd_entry_status(out.value) == 7
    assert ctypes.string_at(lib.dd_entry_body(out.value, ctypes.byref(n)), n.value) == b"py"
    seen = (ctypes.c_int64 * 5)()
    assert lib.dd_entry_what(out.value, seen) == 5 and tuple(seen) == tuple(what)
    lib.dd_entry_decref(out.value)
    # a mismatch, a timeout, an entry a C caller holds after the table dropped it
    other = (ctypes.c_int64 * 1)(1)
    assert lib.dd_begin(table, 9, 2, other, 1, 0.0, ctypes.byref(out)) == -2 and out.value is None
    assert lib.dd_begin(table, 9, 2, other, 6, 0.0, ctypes.byref(out)) == -4
    assert c_begin(3, 0) == 1
    held = out.value
    start = time.monotonic()
    assert c_begin(3, 0.05) == -1 and time.monotonic() - start >= 0.05
    assert t.forget(100) == 3 and len(t) == 0
    assert lib.dd_entry_owned(held) == 1 and lib.dd_entry_done(held) == 0
    lib.dd_interrupt(table, held)                                # harmless: no table holds it
    assert lib.dd_entry_owned(held) == 0
    lib.dd_entry_decref(held)                                    # the last reference: freed
