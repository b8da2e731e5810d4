"""The rounds of a collective's chunk (smb_protocol/rounds.py): the count word's encoding and
which push or pull a memory server admits, with no server."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smb_protocol.errors import InvalidArgument, RoundMismatch
from smb_protocol.rounds import (
    ChunkRound,
    Step,
    admit_pull,
    admit_push,
    arrivals,
    check_pulled_again,
    completes,
    count_word,
    slot_round,
)

WORD = 4096


def test_a_count_word_names_its_round_and_arrivals():
    assert slot_round(0) == -1 and arrivals(0) == 0          # never used
    word = count_word(7, 3)
    assert (slot_round(word), arrivals(word)) == (7, 3)
    assert count_word(7, 8) < count_word(9, 0)               # later rounds are larger words


@given(st.integers(0, (1 << 48) - 8), st.integers(1, (1 << 15) - 1), st.integers(0, (1 << 62) - 1), st.booleans())
def test_a_chunk_round_survives_the_wire_fields(word, parties, round_, root):
    ref = ChunkRound(word, parties, round_, root)
    arg0, arg1 = ref.args()
    assert 0 <= arg0 < 1 << 63 and 0 <= arg1 < 1 << 63        # int64 fields of the frame
    assert ChunkRound.from_args(arg0, arg1) == ref


@pytest.mark.parametrize("args", [(-1, 0), (0, -5), (0, 0)])   # parties 0
def test_wire_fields_that_are_no_chunk_round_are_refused(args):
    with pytest.raises(InvalidArgument):
        ChunkRound.from_args(*args)


def _run_round(word: int, ref: ChunkRound) -> int:
    """Every party pushes, then every party pulls; the final word."""
    for _ in range(ref.parties):
        step, word = admit_push(word, ref)
        assert step in (Step.START, Step.JOIN)
    for _ in range(ref.parties):
        step, word = admit_pull(word, ref)
        assert step is Step.GO
    return word


def test_rounds_of_an_all_reduce_alternate_slots_and_end_at_twice_the_parties():
    words = [0, 0]
    for r in range(6):
        ref = ChunkRound(WORD, 3, r)
        words[r % 2] = _run_round(words[r % 2], ref)
        assert words[r % 2] == ref.end == count_word(r, 6)


def test_the_first_push_stores_later_ones_add():
    ref = ChunkRound(WORD, 2, 0)
    step, word = admit_push(0, ref)
    assert (step, word) == (Step.START, count_word(0, 1))
    assert admit_push(word, ref) == (Step.JOIN, count_word(0, 2))


@pytest.mark.parametrize("parties", [1, 2, 5])
def test_only_the_last_push_of_a_round_completes_it(parties):
    ref = ChunkRound(WORD, parties, 3)
    word = count_word(1, 2 * parties)               # the slot's previous round ended
    for k in range(parties):
        assert completes(word, ref) is (k == parties - 1)
        _, word = admit_push(word, ref)
    assert admit_pull(word, ref)[0] is Step.GO
    assert not completes(count_word(1, 1), ref)     # a push that would have to wait
    assert not completes(count_word(7, 0), ref)     # one that is refused


def test_a_late_party_joins_the_round_the_others_wait_in():
    """Party 0 pushed round 0 and waits for its sum; party 1 opens later and pushes round 0."""
    ref = ChunkRound(WORD, 2, 0)
    _, word = admit_push(0, ref)
    assert admit_pull(word, ref) == (Step.WAIT, ref.ready)     # party 0's sum is not ready
    step, word = admit_push(word, ref)
    assert step is Step.JOIN and admit_pull(word, ref)[0] is Step.GO


def test_a_push_of_the_next_round_on_the_slot_waits_for_every_pull():
    old = ChunkRound(WORD, 2, 0)
    word = count_word(0, 3)                                   # one pull of round 0 missing
    assert admit_push(word, ChunkRound(WORD, 2, 2)) == (Step.WAIT, old.end)
    assert admit_push(old.end, ChunkRound(WORD, 2, 2)) == (Step.START, count_word(2, 1))


def test_a_push_behind_the_slot_is_refused():
    """A party that opened after the others went past round 0, or came back after a
    restart, pushes round 0 into a slot at round 4: refused, nothing added."""
    with pytest.raises(RoundMismatch, match="behind the others"):
        admit_push(count_word(4, 1), ChunkRound(WORD, 2, 0))


def test_one_push_too_many_is_refused():
    ref = ChunkRound(WORD, 2, 0)
    with pytest.raises(RoundMismatch, match="already has all its pushes"):
        admit_push(count_word(0, 2), ref)                    # both pushed, none pulled
    with pytest.raises(RoundMismatch):
        admit_push(count_word(0, 3), ref)                    # a pull is in


def test_a_push_into_the_other_slots_round_is_refused():
    with pytest.raises(RoundMismatch, match="alternate"):
        admit_push(count_word(1, 4), ChunkRound(WORD, 2, 2))


def test_a_broadcast_root_push_counts_every_push_and_its_own_pull():
    ref = ChunkRound(WORD, 3, 5, root=True)
    step, word = admit_push(count_word(3, 6), ref)
    assert (step, word) == (Step.START, count_word(5, 4))
    pull = ChunkRound(WORD, 3, 5)
    for _ in range(2):                                       # the two other parties pull
        step, word = admit_pull(word, pull)
        assert step is Step.GO
    assert word == pull.end
    with pytest.raises(RoundMismatch, match="root"):
        admit_push(count_word(5, 1), ref)                    # a root push joining a round


def test_a_pull_waits_for_its_round_and_is_refused_once_the_round_is_gone():
    ref = ChunkRound(WORD, 2, 2)
    assert admit_pull(count_word(0, 4), ref) == (Step.WAIT, ref.ready)   # round 2 not started
    with pytest.raises(RoundMismatch, match="is gone"):
        admit_pull(count_word(4, 1), ref)
    with pytest.raises(RoundMismatch, match="already pulled"):
        admit_pull(count_word(2, 4), ref)


def test_a_repeated_pull_is_answered_only_while_its_round_holds_the_slot():
    ref = ChunkRound(WORD, 2, 2)
    check_pulled_again(count_word(2, 4), ref)
    with pytest.raises(RoundMismatch, match="overwritten"):
        check_pulled_again(count_word(4, 1), ref)


@given(st.integers(1, 6), st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_no_sequence_of_requests_adds_into_another_rounds_sum(parties, order):
    """Whatever rounds the pushes name, a push is only ever stored or added into a slot
    that holds its own round."""
    word = 0
    for r in order:
        ref = ChunkRound(WORD, parties, 2 * r)     # one slot
        try:
            step, new = admit_push(word, ref)
        except RoundMismatch:
            continue
        if step is Step.WAIT:
            continue
        assert slot_round(new) == ref.round
        word = new


def _oracle_push(word: int, ref: ChunkRound) -> tuple[str, int]:
    """The push rules as the module docstring states them, written out plainly here (the
    server's copy is C): what the native rules must agree with."""
    held, arrived = slot_round(word), arrivals(word)
    if held == ref.round:
        if ref.root or arrived >= ref.parties:
            return "refused", 0
        return "join", word + 1
    if held > ref.round or (held >= 0 and (ref.round - held) % 2):
        return "refused", 0
    if held >= 0 and arrived < 2 * ref.parties:
        return "wait", count_word(held, 2 * ref.parties)
    if held >= 0 and arrived > 2 * ref.parties:
        return "refused", 0
    return "start", count_word(ref.round, ref.weight)


def _oracle_pull(word: int, ref: ChunkRound) -> tuple[str, int]:
    held, arrived = slot_round(word), arrivals(word)
    if held < ref.round or (held == ref.round and arrived < ref.parties):
        return "wait", ref.ready
    if held > ref.round or arrived >= 2 * ref.parties:
        return "refused", 0
    return "go", word + 1


def _native_says(admit, word: int, ref: ChunkRound) -> tuple[str, int]:   # type: ignore[no-untyped-def]
    try:
        step, value = admit(word, ref)
    except RoundMismatch:
        return "refused", 0
    return step.name.lower(), value


@given(st.integers(-1, 40), st.integers(0, 300), st.integers(1, 140), st.integers(0, 40), st.booleans())
def test_the_native_rules_agree_with_the_rules_as_stated(held, arrived, parties, round_, root):
    word = 0 if held < 0 else count_word(held, min(arrived, (1 << 16) - 1))
    push = ChunkRound(WORD, parties, round_, root)
    assert _native_says(admit_push, word, push) == _oracle_push(word, push)
    pull = ChunkRound(WORD, parties, round_)
    assert _native_says(admit_pull, word, pull) == _oracle_pull(word, pull)


def test_a_round_past_what_a_count_word_holds_is_refused_not_wrapped():
    last = (1 << 47) - 2
    assert admit_push(0, ChunkRound(WORD, 2, last)) == (Step.START, count_word(last, 1))
    with pytest.raises(RoundMismatch, match="does not fit a count word"):
        admit_push(0, ChunkRound(WORD, 2, last + 1))
    with pytest.raises(RoundMismatch, match="does not fit a count word"):
        admit_pull(0, ChunkRound(WORD, 2, last + 1))
