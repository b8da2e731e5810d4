"""The rdma transport's two-sided messages: requests, REDUCE messages and replies."""
from __future__ import annotations

import pytest

from smb_protocol import rdma_wire
from smb_protocol.rdma_wire import FINAL, MAX_DESTINATIONS, MSG_BYTES, PUSHED, MsgOp, ReduceMessage


def _message(destinations: int) -> ReduceMessage:
    return ReduceMessage(dtype=0x21, req_id=7, extent_id=1 << 60, offset=4096, length=65536, staging_offset=8192,
                         client=12345, seq=99, arg0=(3 << 48) | 131072, arg1=5, timeout=120.0,
                         destinations=tuple((0x7F00_0000_0000 + i * 4096, 0xABC0 + i, 4096)
                                            for i in range(destinations)))


@pytest.mark.parametrize("n", [0, 1, MAX_DESTINATIONS])
def test_a_reduce_message_round_trips_in_one_slot(n):
    buf = memoryview(bytearray(MSG_BYTES))
    msg = _message(n)
    size = msg.pack(buf)
    assert size <= MSG_BYTES
    assert rdma_wire.request_op(buf) == MsgOp.REDUCE
    assert ReduceMessage.unpack(buf) == msg


def test_a_reduce_message_names_at_most_the_destinations_a_slot_holds():
    assert MAX_DESTINATIONS >= 8
    with pytest.raises(ValueError, match="at most"):
        _message(MAX_DESTINATIONS + 1).pack(memoryview(bytearray(MSG_BYTES)))


def test_other_messages_are_not_taken_for_a_reduce():
    buf = memoryview(bytearray(MSG_BYTES))
    rdma_wire.pack_request(buf, MsgOp.ACCUMULATE, 3, 1, 0, 8)
    assert rdma_wire.request_op(buf) == MsgOp.ACCUMULATE
    with pytest.raises(ValueError, match="not a reduce"):
        ReduceMessage.unpack(buf)
    with pytest.raises(ValueError, match="magic"):
        rdma_wire.request_op(memoryview(bytearray(MSG_BYTES)))


def test_replies_carry_their_kind_and_older_readers_see_the_same_fields():
    buf = memoryview(bytearray(MSG_BYTES))
    rdma_wire.pack_reply(buf, 9, 0, kind=PUSHED)
    assert rdma_wire.unpack_reply_kind(buf) == (9, 0, PUSHED, "")
    rdma_wire.pack_reply(buf, 10, 5, "no such extent")
    assert rdma_wire.unpack_reply_kind(buf) == (10, 5, FINAL, "no such extent")
    assert rdma_wire.unpack_reply(buf) == (10, 5, "no such extent")
