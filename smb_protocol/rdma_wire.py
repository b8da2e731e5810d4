"""Two-sided messages of the rdma transport (client <-> memory server).

One-sided READ/WRITE and atomics need no messages. Server-side arithmetic does: the
client RDMA-WRITEs the operand into its connection's staging area on the server, then
SENDs a :data:`REQUEST` naming the operation, the target range and the staging offset;
RC ordering makes the WRITE visible before the SEND is received. The server computes
(under the extent's lock) and SENDs back a :data:`REPLY` with the same ``req_id``, a
status code (:class:`smb_protocol.errors.Status`) and a short UTF-8 message on errors.

Every message fits one :data:`MSG_BYTES` slot; integers are little-endian. ``client`` and
``seq`` number a request for exactly-once service, as on the tcp plane (``seq`` 0: not
tracked): a request sent again (on a new queue pair) is answered, not applied twice.

Request: magic u32 | op u8 | dtype u8 | pad u16 | req_id u32 | extent_id u64 |
         offset u64 | length u64 | staging_offset u64 | alpha f64 | client u64 | seq u64
Reduce:  magic u32 | op u8 (REDUCE) | dtype u8 | destinations u8 | pad u8 | req_id u32 |
         extent_id u64 | offset u64 | length u64 | staging_offset u64 | client u64 |
         seq u64 | arg0 u64 | arg1 u64 | timeout f64, then per destination:
         address u64 | rkey u32 | length u32
Reply:   magic u32 | req_id u32 | status u8 | kind u8 | message length u16 | message

A collective's chunk (``REDUCE``, :class:`smb_protocol.requests.Reduce`; ``arg0``/``arg1``
are its round as :meth:`smb_protocol.rounds.ChunkRound.args` packs it) is pushed the
same way, from the staging area, and answered twice: a reply of kind :data:`PUSHED` once
its push took effect (the client may reuse that staging range), then, once every party
pushed, the server RDMA-WRITEs the sum into the client's registered destinations (the
chunk's receive buffers, in order) and SENDs the final reply: RC ordering makes the
sum visible before the reply is received.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = 0x52424D53                 # "SMBR"
MSG_BYTES = 256                    # bytes per message slot (requests and replies)
REQUEST = struct.Struct("<IBBHIQQQQdQQ")
REPLY = struct.Struct("<IIBBH")
REDUCE = struct.Struct("<IBBBBIQQQQQQQQd")
DESTINATION = struct.Struct("<QII")
MAX_DESTINATIONS = (MSG_BYTES - REDUCE.size) // DESTINATION.size
FINAL = 0                          # reply kinds: the request's answer
PUSHED = 1                         # a REDUCE's push took effect; its sum follows
MAX_MESSAGE = MSG_BYTES - REPLY.size


class MsgOp(enum.IntEnum):
    ACCUMULATE = 1     # extent += staging
    AXPY = 2           # extent += alpha * staging
    SCALE = 3          # extent *= alpha (no payload)
    BYE = 4            # the client is closing this connection
    REDUCE = 5         # a collective chunk: push from staging, sum written back (see above)


def pack_request(buf: memoryview, op: int, req_id: int, extent_id: int = 0, offset: int = 0,
                 length: int = 0, dtype: int = 0, staging_offset: int = 0, alpha: float = 0.0,
                 client: int = 0, seq: int = 0) -> None:
    REQUEST.pack_into(buf, 0, MAGIC, op, dtype, 0, req_id & 0xFFFFFFFF, extent_id, offset, length,
                      staging_offset, alpha, client, seq)


def unpack_request(buf: memoryview) -> tuple[int, int, int, int, int, int, int, float, int, int]:
    """(op, dtype, req_id, extent_id, offset, length, staging_offset, alpha, client, seq);
    ValueError on a bad magic."""
    (magic, op, dtype, _pad, req_id, extent_id, offset, length, staging, alpha, client,
     seq) = REQUEST.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"bad request magic {magic:#x}")
    return op, dtype, req_id, extent_id, offset, length, staging, alpha, client, seq


def request_op(buf: memoryview) -> int:
    """The operation of the request message in ``buf`` (ValueError on a bad magic)."""
    magic, op = struct.unpack_from("<IB", buf)
    if magic != MAGIC:
        raise ValueError(f"bad request magic {magic:#x}")
    return int(op)


@dataclass(frozen=True, slots=True)
class ReduceMessage:
    """The fields of a ``REDUCE`` message (see the module doc); ``destinations``:
    (address, rkey, length) of each receive buffer of the sum, in order."""

    dtype: int
    req_id: int
    extent_id: int
    offset: int
    length: int
    staging_offset: int
    client: int
    seq: int
    arg0: int
    arg1: int
    timeout: float
    destinations: tuple[tuple[int, int, int], ...]

    def pack(self, buf: memoryview) -> int:
        """Write the message into ``buf``; returns its size in bytes."""
        n = len(self.destinations)
        if n > MAX_DESTINATIONS:
            raise ValueError(f"a reduce names at most {MAX_DESTINATIONS} destinations, not {n}")
        REDUCE.pack_into(buf, 0, MAGIC, MsgOp.REDUCE, self.dtype, n, 0, self.req_id & 0xFFFFFFFF,
                         self.extent_id, self.offset, self.length, self.staging_offset, self.client,
                         self.seq, self.arg0, self.arg1, self.timeout)
        for i, dest in enumerate(self.destinations):
            DESTINATION.pack_into(buf, REDUCE.size + i * DESTINATION.size, *dest)
        return REDUCE.size + n * DESTINATION.size

    @classmethod
    def unpack(cls, buf: memoryview) -> ReduceMessage:
        """ValueError on a bad magic or destination count."""
        (magic, op, dtype, n, _pad, req_id, extent_id, offset, length, staging, client, seq, arg0, arg1,
         timeout) = REDUCE.unpack_from(buf)
        if magic != MAGIC or op != MsgOp.REDUCE:
            raise ValueError(f"not a reduce message (magic {magic:#x}, op {op})")
        if n > MAX_DESTINATIONS:
            raise ValueError(f"{n} destinations (at most {MAX_DESTINATIONS})")
        dests = tuple(DESTINATION.unpack_from(buf, REDUCE.size + i * DESTINATION.size) for i in range(n))
        return cls(dtype, req_id, extent_id, offset, length, staging, client, seq, arg0, arg1, timeout, dests)


def pack_reply(buf: memoryview, req_id: int, status: int, message: str = "", kind: int = FINAL) -> int:
    """Write a reply into ``buf``; returns its size in bytes."""
    raw = message.encode(errors="replace")[:MAX_MESSAGE]
    REPLY.pack_into(buf, 0, MAGIC, req_id & 0xFFFFFFFF, status, kind, len(raw))
    buf[REPLY.size:REPLY.size + len(raw)] = raw
    return REPLY.size + len(raw)


def unpack_reply(buf: memoryview) -> tuple[int, int, str]:
    """(req_id, status, message); ValueError on a bad magic."""
    req_id, status, _kind, message = unpack_reply_kind(buf)
    return req_id, status, message


def unpack_reply_kind(buf: memoryview) -> tuple[int, int, int, str]:
    """(req_id, status, kind, message); ValueError on a bad magic."""
    magic, req_id, status, kind, n = REPLY.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"bad reply magic {magic:#x}")
    return req_id, status, kind, bytes(buf[REPLY.size:REPLY.size + min(n, MAX_MESSAGE)]).decode(errors="replace")
