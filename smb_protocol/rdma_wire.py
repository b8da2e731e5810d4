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
Reply:   magic u32 | req_id u32 | status u8 | pad u8 | message length u16 | message
"""
from __future__ import annotations

import enum
import struct

MAGIC = 0x52424D53                 # "SMBR"
MSG_BYTES = 256                    # bytes per message slot (requests and replies)
REQUEST = struct.Struct("<IBBHIQQQQdQQ")
REPLY = struct.Struct("<IIBxH")
MAX_MESSAGE = MSG_BYTES - REPLY.size


class MsgOp(enum.IntEnum):
    ACCUMULATE = 1     # extent += staging
    AXPY = 2           # extent += alpha * staging
    SCALE = 3          # extent *= alpha (no payload)
    BYE = 4            # the client is closing this connection


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


def pack_reply(buf: memoryview, req_id: int, status: int, message: str = "") -> int:
    """Write a reply into ``buf``; returns its size in bytes."""
    raw = message.encode(errors="replace")[:MAX_MESSAGE]
    REPLY.pack_into(buf, 0, MAGIC, req_id & 0xFFFFFFFF, status, len(raw))
    buf[REPLY.size:REPLY.size + len(raw)] = raw
    return REPLY.size + len(raw)


def unpack_reply(buf: memoryview) -> tuple[int, int, str]:
    """(req_id, status, message); ValueError on a bad magic."""
    magic, req_id, status, n = REPLY.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"bad reply magic {magic:#x}")
    return req_id, status, bytes(buf[REPLY.size:REPLY.size + min(n, MAX_MESSAGE)]).decode(errors="replace")
