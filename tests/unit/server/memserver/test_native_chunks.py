"""The memory server's extent lock and a collective chunk's round step, in C
(smb_server/memserver/native/chunks.c): the lock shared with Python, every dtype's push
stored or added exactly as the server's kernels do it, the round rules applied under
the lock, bad bounds refused, and concurrent pushes never losing a contribution."""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from smb_protocol.chunk_types import widen
from smb_protocol.dtypes import STORAGE, DType, f32_to_bf16
from smb_protocol.rounds import ChunkRound, arrivals, count_word, refusal, slot_round
from smb_server.memserver import _native

N = 1024                     # elements of a slot
INTEGERS = (DType.INT32, DType.INT64)
TYPES = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16) + INTEGERS


def _extent(dt: DType) -> tuple[np.ndarray, int, int]:
    """Extent memory holding one slot of N elements of ``dt`` at 0, its count word after
    it; returns (memory, slot offset, word offset)."""
    size = N * STORAGE[dt].itemsize
    word = (size + 7) // 8 * 8
    return np.zeros(word + 8, np.uint8), 0, word


def _word(mem: np.ndarray, word: int) -> int:
    return int(mem[word:word + 8].view("<i8")[0])


def _values(dt: DType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dt in INTEGERS:
        info = np.iinfo(STORAGE[dt])
        return rng.integers(info.min, info.max, N, dtype=STORAGE[dt], endpoint=True)
    x = rng.standard_normal(N).astype(np.float32)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(x)
    return x.astype(STORAGE[dt])


def _add(dt: DType, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sum the server's kernels define: integers wrap, 16-bit floats widened to
    float32, added there and rounded once, float32 and float64 in their own type."""
    if dt in INTEGERS:
        return (a.astype(np.int64) + b.astype(np.int64)).astype(STORAGE[dt]) if dt is DType.INT32 else a + b
    if dt is DType.BFLOAT16:
        wa, wb = np.empty(N, np.float32), np.empty(N, np.float32)
        widen(a, DType.BFLOAT16, wa)
        widen(b, DType.BFLOAT16, wb)
        return f32_to_bf16(wa + wb)
    if dt is DType.FLOAT16:
        return (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    return a + b


@pytest.mark.parametrize("dt", TYPES, ids=lambda d: d.name.lower())
def test_a_round_of_two_pushes_stores_then_adds_in_the_slots_type(dt: DType) -> None:
    mem, slot, word = _extent(dt)
    lock, data = _native.Mutex(), mem.data.cast("B")
    a, b = _values(dt, 1), _values(dt, 2)
    step, old, new = _native.push_step(lock, data, word, slot, a.data.cast("B"), dt, 0, 2, 0, False)
    assert (step, old, new) == (_native.R_START, 0, count_word(0, 1)) and _word(mem, word) == new
    step, old, new = _native.push_step(lock, data, word, slot, b.data.cast("B"), dt, 0, 2, 0, False)
    assert (step, old, new) == (_native.R_JOIN, count_word(0, 1), count_word(0, 2))
    got = mem[slot:slot + N * STORAGE[dt].itemsize].view(STORAGE[dt])
    assert got.tobytes() == _add(dt, a, b).tobytes()          # bit for bit; integers exact
    assert not lock.locked()


@pytest.mark.parametrize("wire", (DType.BFLOAT16, DType.FLOAT16), ids=lambda d: d.name.lower())
def test_16_bit_pushes_are_widened_into_a_float32_slot_and_summed_there(wire: DType) -> None:
    mem, slot, word = _extent(DType.FLOAT32)
    lock, data = _native.Mutex(), mem.data.cast("B")
    pushes = [_values(wire, seed) for seed in range(3)]
    for p in pushes:
        step, _, _ = _native.push_step(lock, data, word, slot, p.data.cast("B"), DType.FLOAT32, wire, 3, 0, False)
        assert step in (_native.R_START, _native.R_JOIN)
    wide = []
    for p in pushes:
        w = np.empty(N, np.float32)
        widen(p, wire, w)
        wide.append(w)
    want = (wide[0] + wide[1]) + wide[2]                      # float32 sums, never rounded to 16 bits
    assert mem[slot:slot + 4 * N].view(np.float32).tobytes() == want.tobytes()
    assert arrivals(_word(mem, word)) == 3


def test_a_push_a_round_ahead_waits_and_changes_nothing() -> None:
    mem, slot, word = _extent(DType.INT64)
    lock, data = _native.Mutex(), mem.data.cast("B")
    mem[word:word + 8].view("<i8")[0] = count_word(0, 3)        # round 0 of 2 parties: one pull to go
    before = mem.copy()
    step, old, value = _native.push_step(lock, data, word, slot, _values(DType.INT64, 1).data.cast("B"),
                                         DType.INT64, 0, 2, 2, False)
    assert (step, old, value) == (_native.R_WAIT, count_word(0, 3), count_word(0, 4))
    assert np.array_equal(mem, before)


def test_a_refused_push_changes_nothing_and_says_why() -> None:
    mem, slot, word = _extent(DType.INT64)
    lock, data = _native.Mutex(), mem.data.cast("B")
    mem[word:word + 8].view("<i8")[0] = count_word(0, 2)        # round 0 has both pushes
    before = mem.copy()
    step, old, _ = _native.push_step(lock, data, word, slot, _values(DType.INT64, 1).data.cast("B"),
                                     DType.INT64, 0, 2, 0, False)
    assert step < 0 and np.array_equal(mem, before)
    assert "already has all its pushes" in str(refusal(step, old, ChunkRound(word, 2, 0)))


@pytest.mark.parametrize("word, slot, nbytes", [
    (-8, 0, 64), (12, 64, 64), (4096, 0, 64),     # word outside or misaligned
    (0, 4, 64),                                   # the slot over its count word
    (512, 512 - 32, 64),                          # ... from below
    (8, 4096 - 32, 64),                           # the slot past the end
])
def test_bounds_the_caller_got_wrong_are_refused_before_anything_is_written(word: int, slot: int,
                                                                            nbytes: int) -> None:
    mem = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError):
        _native.push_step(_native.Mutex(), mem.data.cast("B"), word, slot, bytes(nbytes), DType.FLOAT32, 0,
                          2, 0, False)
    assert not mem.any()


def test_a_push_of_the_wrong_types_is_refused() -> None:
    mem = np.zeros(4096, np.uint8)
    data = mem.data.cast("B")
    for slot_code, wire, nbytes in [(99, 0, 64), (DType.FLOAT32, 0, 6), (DType.FLOAT64, DType.BFLOAT16, 64),
                                    (DType.FLOAT32, DType.INT32, 64)]:
        with pytest.raises(ValueError):
            _native.push_step(_native.Mutex(), data, 4088, 0, bytes(nbytes), slot_code, wire, 2, 0, False)
    assert not mem.any()


def test_concurrent_pushes_of_many_threads_lose_no_contribution() -> None:
    parties, rounds = 8, 40
    mem, slot, word = _extent(DType.INT64)
    lock, data = _native.Mutex(), mem.data.cast("B")
    ones = np.ones(N, np.int64).data.cast("B")
    sums: list[int] = []
    done = threading.Barrier(parties)

    def party(rank: int) -> None:
        for r in range(0, 2 * rounds, 2):   # this slot's rounds (the other slot has the odd ones)
            step = _native.R_WAIT
            while step == _native.R_WAIT:
                step, _, _ = _native.push_step(lock, data, word, slot, ones, DType.INT64, 0, parties, r, False)
            assert step in (_native.R_START, _native.R_JOIN)
            while arrivals(_word(mem, word)) < parties or slot_round(_word(mem, word)) != r:
                time.sleep(0)
            if rank == 0:
                sums.append(int(mem[slot:slot + 8 * N].view(np.int64).min()))
            done.wait()
            _native.pull_count(lock, data, word)
            done.wait()
    threads = [threading.Thread(target=party, args=(i,)) for i in range(parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == [parties] * rounds
    assert _word(mem, word) == count_word(2 * rounds - 2, 2 * parties)


def _sleeping(native_id: int) -> bool:
    """Whether the thread ``native_id`` of this process sleeps in the kernel now."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "S"


def test_pushes_are_counted_and_so_are_those_that_waited_for_the_lock() -> None:
    mem, slot, word = _extent(DType.INT64)
    lock, data = _native.Mutex(), mem.data.cast("B")
    ones = np.ones(N, np.int64).data.cast("B")
    pushes, waited = _native.push_counts()
    _native.push_step(lock, data, word, slot, ones, DType.INT64, 0, 3, 0, False)
    assert _native.push_counts() == (pushes + 1, waited)        # the lock was free
    # a push while Python holds the extent's lock: it waits, then counts as waited. This
    # thread gets the interpreter back only once the pusher let it go inside push_step
    # (no switch interval takes it away before), so from then on the pusher's only sleep
    # is its wait for the lock
    before = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    started = threading.Event()

    def pusher() -> None:
        started.set()
        _native.push_step(lock, data, word, slot, ones, DType.INT64, 0, 3, 0, False)
    t = threading.Thread(target=pusher)
    lock.acquire()
    try:
        t.start()
        assert started.wait(10)
        deadline = time.monotonic() + 10
        while not _sleeping(t.native_id) and time.monotonic() < deadline:
            pass
        assert _sleeping(t.native_id)
    finally:   # let the pusher go whatever happened, so that it never outlives the test
        lock.release()
        sys.setswitchinterval(before)
        t.join(10)
    assert _native.push_counts() == (pushes + 2, waited + 1)
    assert _word(mem, word) == count_word(0, 2)


def test_the_lock_is_shared_refuses_misuse_and_lets_the_interpreter_go_while_waiting() -> None:
    lock = _native.Mutex()
    assert lock.acquire() and lock.locked()
    with pytest.raises(RuntimeError):
        lock.acquire()                                          # this thread holds it
    assert lock.acquire(timeout=0) is False
    ticks, stop = [], threading.Event()
    got = threading.Event()

    def waiter() -> None:
        with lock:
            got.set()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)
    tw, tt = threading.Thread(target=waiter), threading.Thread(target=ticker)
    tw.start()
    tt.start()
    time.sleep(0.2)
    assert not got.is_set() and len(ticks) > 20                 # the waiter holds no interpreter
    assert _in_another_thread(lock.release) == "RuntimeError"   # only the holder lets it go
    lock.release()
    assert got.wait(5)
    stop.set()
    tw.join(5)
    tt.join(5)
    assert not lock.locked()
    start = time.monotonic()
    with lock:
        assert threading_acquire_times_out(lock)
    assert time.monotonic() - start < 5


def _in_another_thread(call) -> str:   # type: ignore[no-untyped-def]
    """The name of what ``call`` raised on a thread of its own ("" for nothing)."""
    out: list[str] = []

    def run() -> None:
        try:
            call()
            out.append("")
        except Exception as exc:
            out.append(type(exc).__name__)
    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    return out[0]


def threading_acquire_times_out(lock: _native.Mutex) -> bool:
    """Another thread's acquire with a timeout gives up (False) while this one holds it."""
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(lock.acquire(timeout=0.05)))
    t.start()
    t.join(5)
    return out == [False]
