"""A chunk in a wire type on the client: the pieces narrowed into one pushed buffer of
half their bytes, the sum widened back into the pieces, or received straight into them
when it comes back in full (smb_client/wire_chunk.py)."""
from __future__ import annotations

import numpy as np
import pytest

from smb_client.wire_chunk import WireChunk
from smb_protocol.chunk_types import ChunkTypes
from smb_protocol.dtypes import DType, bf16_to_f32, f32_to_bf16
from smb_protocol.errors import Misaligned


def _pieces(buf: np.ndarray, cuts: list[int]) -> list[memoryview]:
    raw = memoryview(buf).cast("B")
    edges = [0, *cuts, len(raw)]
    return [raw[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def test_pieces_are_narrowed_into_one_buffer_and_the_sum_widened_back():
    x = np.arange(1000, dtype=np.float32) / 7
    parts = _pieces(x, [400, 1600])
    w = WireChunk(parts, ChunkTypes(DType.FLOAT32, DType.BFLOAT16))
    assert w.nbytes == 2000 and sum(len(p) for p in w.sent) == 2000
    np.testing.assert_array_equal(np.frombuffer(w.sent[0], np.uint16), f32_to_bf16(x))
    (into,) = w.into
    sum16 = f32_to_bf16(x * 3)
    memoryview(into)[:] = sum16.tobytes()         # the server's answer
    w.received()
    np.testing.assert_array_equal(x, bf16_to_f32(sum16))


def test_a_full_sum_is_received_into_the_pieces_themselves():
    x = np.ones(100, np.float32)
    parts = _pieces(x, [200])
    w = WireChunk(parts, ChunkTypes(DType.FLOAT32, DType.FLOAT16, full=True))
    assert w.into == parts and w.nbytes == 200
    w.received()                                  # nothing to widen
    np.testing.assert_array_equal(x, np.ones(100, np.float32))


def test_a_piece_that_cuts_an_element_is_refused():
    x = np.ones(100, np.float32)
    with pytest.raises(Misaligned):
        WireChunk(_pieces(x, [6]), ChunkTypes(DType.FLOAT32, DType.BFLOAT16))
