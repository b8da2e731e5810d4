/* The socket low-water mark a read sets for a payload (the rule of
 * smb_protocol.sockio.LOWAT_MIN, whose Python loop follows it too): a read that waits
 * for at least LOWAT_MIN more bytes sets SO_RCVLOWAT to what is still to come, at most
 * LOWAT_MAX, so the kernel wakes the reader once for them instead of once per few
 * segments; never above what is still to come (the kernel would not wake the reader
 * for less), and one byte for anything shorter. Such a read polls, then takes what is
 * there: a receive that took part of the bytes and then slept would not be woken by the
 * rest. Used by the memory server's native loop (serve.c) and a client stream's answers
 * (smb_client/transports/answers.c). */
#ifndef SMB_PROTOCOL_LOWAT_H
#define SMB_PROTOCOL_LOWAT_H

#include <stddef.h>

#define LOWAT_MIN (32 << 10)
#define LOWAT_MAX (1 << 20)

/* the low-water mark for a read with ``left`` bytes still to come */
static inline int lowat_for(size_t left)
{
    return left < LOWAT_MIN ? 1 : left < LOWAT_MAX ? (int)left : LOWAT_MAX;
}

#endif
