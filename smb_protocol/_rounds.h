/* The rounds of a collective's chunk: which push or pull a memory server admits, given
 * the slot's count word (the rules, their wire fields and their error messages are
 * described in smb_protocol/rounds.py, which calls these through smb_protocol._native;
 * the memory server's chunk step, smb_server/memserver/native/chunks.c, applies them
 * under the extent's lock). One copy of the rules, in C, because the step that applies
 * them runs without the interpreter.
 *
 * A count word is ((round + 1) << ROUND_SHIFT) | arrivals, 0 for a slot never used.
 * Rounds past ROUND_LIMIT do not fit a count word and are refused (R_TOO_LATE). */
#ifndef SMB_PROTOCOL_ROUNDS_H
#define SMB_PROTOCOL_ROUNDS_H

#include <stdint.h>

#define ROUND_SHIFT 16
#define ROUND_LIMIT ((INT64_C(1) << (63 - ROUND_SHIFT)) - 2)   /* the last round a count word holds */

enum round_step {
    R_START = 0,          /* a push: store the chunk, the round's first arrival */
    R_JOIN = 1,           /* a push: add the chunk into the round's sum */
    R_GO = 2,             /* a pull: send the sum and count the pull */
    R_WAIT = 3,           /* wait until the count word reaches the value, then ask again */
    /* refusals (RoundMismatch, messages in rounds.py) */
    R_ROOT_LATE = -1,     /* a broadcast root's push after other arrivals */
    R_FULL = -2,          /* a push of a round that has every push */
    R_BEHIND = -3,        /* a push of a round the slot went past */
    R_OTHER_SLOT = -4,    /* a push of a round of the other slot */
    R_OVERFULL = -5,      /* the slot's round has more arrivals than its parties allow */
    R_GONE = -6,          /* a pull of a round the slot went past */
    R_ALL_PULLED = -7,    /* a pull of a round every party pulled */
    R_TOO_LATE = -8,      /* a round past ROUND_LIMIT */
};

static inline int64_t round_word(int64_t round, int64_t arrived)
{
    return (int64_t)(((uint64_t)round + 1) << ROUND_SHIFT) | arrived;
}

static inline int64_t round_held(int64_t word) { return (word >> ROUND_SHIFT) - 1; }

static inline int64_t round_arrivals(int64_t word) { return word & ((INT64_C(1) << ROUND_SHIFT) - 1); }

/* What a push of (parties, round, root) does to a slot whose count word is ``word``:
 * R_START or R_JOIN with the new word in *value, R_WAIT with the word to wait for, or
 * a refusal. */
static inline int round_admit_push(int64_t word, int64_t parties, int64_t round, int root, int64_t *value)
{
    int64_t held = round_held(word), arrived = round_arrivals(word);
    if (round > ROUND_LIMIT)
        return R_TOO_LATE;
    if (held == round) {
        if (root)
            return R_ROOT_LATE;
        if (arrived >= parties)
            return R_FULL;
        *value = word + 1;
        return R_JOIN;
    }
    if (held > round)
        return R_BEHIND;
    if (held >= 0) {
        if ((round - held) % 2)
            return R_OTHER_SLOT;
        if (arrived < 2 * parties) {
            *value = round_word(held, 2 * parties);
            return R_WAIT;
        }
        if (arrived > 2 * parties)
            return R_OVERFULL;
    }
    *value = round_word(round, root ? parties + 1 : 1);
    return R_START;
}

/* What a pull of (parties, round) does: R_GO with the new word, R_WAIT with the word
 * to wait for (the round's sum ready), or a refusal. */
static inline int round_admit_pull(int64_t word, int64_t parties, int64_t round, int64_t *value)
{
    int64_t held = round_held(word), arrived = round_arrivals(word);
    if (round > ROUND_LIMIT)
        return R_TOO_LATE;
    if (held < round || (held == round && arrived < parties)) {
        *value = round_word(round, parties);
        return R_WAIT;
    }
    if (held > round)
        return R_GONE;
    if (arrived >= 2 * parties)
        return R_ALL_PULLED;
    *value = word + 1;
    return R_GO;
}

#endif
