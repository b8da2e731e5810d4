"""The rounds of a collective's chunk: what its count word says, and which push or pull
a memory server admits (pure; the server applies it in ``smb_server/memserver/collective_ops.py``,
the client numbers the rounds in ``smb_client/collective.py``). The admission rules
themselves are C (``smb_protocol/_rounds.h``, called here through :mod:`smb_protocol._native`):
the server's chunk step applies them under the extent's lock without the interpreter,
and a rule written once cannot drift between the two. Their refusals' messages are here.

A collective's chunk has two slots, each with an int64 *count word* beside it. Round
``r`` of the collective uses slot ``r % 2``. The count word names the round its slot
holds and how far that round got::

    word = (r + 1) << ROUND_SHIFT | arrivals          (0: the slot was never used)

Every round of ``parties`` parties ends at ``2 × parties`` arrivals: in an all-reduce
each party's push counts 1 and each party's pull 1; in a broadcast the root's push
counts ``parties + 1`` (it stands for every party's push and for its own pull) and each
other party's pull 1. A round's sum is ready once ``parties`` arrivals are in.

Every push and pull names its round (:class:`ChunkRound`), so the server can refuse
what does not fit the slot with :class:`~smb_protocol.errors.RoundMismatch` instead of
adding it into another round's sum:

* a push of the round the slot holds joins it while pushes are still missing, and is
  refused once every party pushed;
* a push of a later round waits until the slot's round ended (every party pulled it),
  then stores its chunk as the new round's first arrival; a push of an earlier round is
  refused (its party is behind the others: it opened late, or came back after a restart);
* a pull waits until its round's sum is ready and is refused once the slot moved on to a
  later round, or every party already pulled.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from . import _native
from .errors import InvalidArgument, RoundMismatch

ROUND_SHIFT = 16                 # bits of a count word that count a round's arrivals
MAX_PARTIES = (1 << 15) - 1      # parties a chunk request can name (2 × parties arrivals fit the low bits)
WORD_BITS = 48                   # bits of a chunk request's arg0 that hold the count word's offset
ROOT = 1 << 62                   # in a push's arg1: the push of a broadcast's root
MAX_ROUND = ROOT - 1             # the highest round a request can name
LAST_ROUND = (1 << (63 - ROUND_SHIFT)) - 2   # the highest round a count word holds (later ones are refused)

__all__ = ["ROUND_SHIFT", "MAX_PARTIES", "ChunkRound", "Step", "count_word", "slot_round", "arrivals",
           "admit_push", "admit_pull", "check_pulled_again", "refusal"]


def count_word(round_: int, arrived: int) -> int:
    """The count word of a slot holding round ``round_`` with ``arrived`` arrivals."""
    return ((round_ + 1) << ROUND_SHIFT) | arrived


def slot_round(word: int) -> int:
    """The round a slot's count word names (-1: the slot was never used)."""
    return (word >> ROUND_SHIFT) - 1


def arrivals(word: int) -> int:
    """The arrivals (pushes and pulls) of the round a count word names."""
    return word & ((1 << ROUND_SHIFT) - 1)


@dataclass(frozen=True, slots=True)
class ChunkRound:
    """Which round of which chunk a push or pull belongs to: ``word`` (bytes, the extent
    offset of the slot's count word), the collective's ``parties``, the ``round`` (from
    0) and, for a push, whether it is a broadcast ``root``'s."""

    word: int
    parties: int
    round: int
    root: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.parties <= MAX_PARTIES:
            raise InvalidArgument(f"parties must lie in 1..{MAX_PARTIES}, not {self.parties}")
        if not 0 <= self.round <= MAX_ROUND:
            raise InvalidArgument(f"a collective's round must lie in 0..{MAX_ROUND}, not {self.round}")
        if not 0 <= self.word < 1 << WORD_BITS:
            raise InvalidArgument(f"count word offset {self.word} does not fit {WORD_BITS} bits")

    @property
    def weight(self) -> int:
        """What this push adds to the count."""
        return self.parties + 1 if self.root else 1

    @property
    def ready(self) -> int:
        """The count word once the round's sum is ready (every push in)."""
        return count_word(self.round, self.parties)

    @property
    def end(self) -> int:
        """The count word once the round ended (every party pulled)."""
        return count_word(self.round, 2 * self.parties)

    def args(self) -> tuple[int, int]:
        """The request's ``(arg0, arg1)`` on the wire (see :mod:`smb_protocol.wire`)."""
        return self.word | (self.parties << WORD_BITS), self.round | (ROOT if self.root else 0)

    @classmethod
    def from_args(cls, arg0: int, arg1: int) -> ChunkRound:
        """The request's chunk round from its wire fields; InvalidArgument when they
        cannot be one."""
        if arg0 < 0 or arg1 < 0:
            raise InvalidArgument("a chunk request's arg0 and arg1 must not be negative")
        return cls(arg0 & ((1 << WORD_BITS) - 1), arg0 >> WORD_BITS, arg1 & MAX_ROUND, bool(arg1 & ROOT))

    def describe(self) -> str:
        return f"round {self.round} of {self.parties} parties"


class Step(enum.Enum):
    """What a push or pull does next, given the count word (see :func:`admit_push`);
    the values are the native rules' codes (``smb_protocol/_rounds.h``)."""

    START = 0   # store the chunk: the round's first arrival
    JOIN = 1    # add the chunk into the round's sum
    GO = 2      # (a pull) send the sum and count the pull
    WAIT = 3    # wait until the count word reaches the value, then ask again


_STEPS = {step.value: step for step in Step}


def refusal(code: int, word: int, ref: ChunkRound) -> RoundMismatch:
    """The error for the rules' refusal ``code`` (negative, ``smb_protocol/_rounds.h``)
    of the push or pull of ``ref`` at the count word ``word``."""
    held, arrived = slot_round(word), arrivals(word)
    messages = {
        -1: f"a broadcast root's push of {ref.describe()} came after {arrived} arrivals: only one "
            "party is the root, and its push comes first",
        -2: f"{ref.describe()} already has all its pushes ({arrived} arrivals): a party pushed twice, "
            f"or more than {ref.parties} parties use the collective",
        -3: f"the chunk is at round {held}, and this push is of round {ref.round}: this party is behind "
            "the others (it opened the collective after they went past this round, or came back after "
            "a restart); every party must make a new collective",
        -4: f"round {ref.round} pushed into the slot of round {held}: the slots alternate",
        -5: f"the chunk's round {held} had {arrived} arrivals, more than {2 * ref.parties} for "
            f"{ref.parties} parties",
        -6: f"the chunk is at round {held}: the sum of round {ref.round} is gone (this party is behind "
            "the others, or pulled a round it was not part of)",
        -7: f"every one of the {ref.parties} parties already pulled {ref.describe()}",
        -8: f"round {ref.round} does not fit a count word (at most {LAST_ROUND}): make a new collective",
    }
    return RoundMismatch(messages[code])


def admit_push(word: int, ref: ChunkRound) -> tuple[Step, int]:
    """What a push of ``ref`` does to a slot whose count word is ``word``: ``(START, new
    word)``, ``(JOIN, new word)`` or ``(WAIT, word to wait for)``; raises RoundMismatch
    for a push that belongs to no round the slot can take. The rules are native (the
    memory server applies them under the extent's lock without the interpreter)."""
    code, value = _native.admit_push(word, ref.parties, ref.round, ref.root)
    if code < 0:
        raise refusal(code, word, ref)
    return _STEPS[code], value


def admit_pull(word: int, ref: ChunkRound) -> tuple[Step, int]:
    """What a pull of ``ref`` does: ``(GO, new word)`` (send the sum, then store the new
    word) or ``(WAIT, word to wait for)``; raises RoundMismatch when the round's sum is
    gone or every party already pulled it."""
    code, value = _native.admit_pull(word, ref.parties, ref.round)
    if code < 0:
        raise refusal(code, word, ref)
    return _STEPS[code], value


def completes(old: int, ref: ChunkRound) -> bool:
    """Whether the push of ``ref`` admitted at the count word ``old`` (the word it found)
    made the round's sum ready: it was the last push the round waited for."""
    try:
        step, word = admit_push(old, ref)
    except RoundMismatch:
        return False
    return step is not Step.WAIT and slot_round(word) == ref.round and arrivals(word) >= ref.parties


def check_pulled_again(word: int, ref: ChunkRound) -> None:
    """A repeated pull (its first attempt counted) may send the sum again only while the
    slot still holds its round; RoundMismatch once a later round took the slot."""
    held = slot_round(word)
    if held != ref.round or arrivals(word) < ref.parties:
        raise RoundMismatch(f"the chunk is at round {held}: the sum of round {ref.round}, pulled once "
                            "already, was overwritten before this repeat; the collective cannot go on")
