"""A collective's pull on a memory server (collective_ops.pull) answers once: an extent
released right after the sum went out (the region deleted by a party that finished
first) ends the pull quietly instead of a second, error answer under the same request
id, which a client's stream takes for an answer to a request not in flight. The
connection is a recording double of the engine's Peer (peer_double.py); the arena,
exactly-once table, waits and the deliveries' queue and thread are the server's own."""
from __future__ import annotations

import sys
import threading

import numpy as np

from smb_protocol import tickets
from smb_protocol.chunk_types import ChunkTypes, narrow, widen
from smb_protocol.dtypes import DType
from smb_protocol.errors import SMBError
from smb_protocol.requests import Pull, Reduce
from smb_protocol.rounds import ChunkRound, count_word
from smb_protocol.wire import Op
from smb_server.memserver import collective_ops, kernels
from smb_server.memserver.arena import Arena
from smb_server.memserver.deliveries import Deliveries
from smb_server.memserver.engine import Engine
from smb_server.memserver.node import Node
from tests.unit.server.memserver.peer_double import PeerDouble

SECRET = b"s" * 32
UID = "region-pull"
CHUNK = 4096
WORD = 2 * CHUNK


def test_a_pull_whose_extent_is_released_after_its_answer_went_out_answers_once():
    arena = Arena(16 << 20)
    node = Node(arena, SECRET)
    try:
        extent = arena.reserve(1, UID, 4 * CHUNK)
        ref = ChunkRound(WORD, 1, 0)
        extent.data[WORD:WORD + 8] = count_word(0, 1).to_bytes(8, "little")   # the push is in
        token = tickets.sign(SECRET, UID, [1], "rw", ttl=600.0)[0]
        conn = PeerDouble(SECRET, token, on_send=lambda: arena.release(1))
        served = threading.Event()
        broken: list[BaseException] = []

        def serve(pull: Pull) -> None:
            try:
                collective_ops.pull(node, conn, pull)
            finally:
                served.set()

        def fail(pull: Pull, err: SMBError) -> None:
            conn.answers.append((pull.req_id, f"error: {err}"))

        deliveries = Deliveries(serve, fail, broken.append, "test")
        try:
            deliveries.put(Pull(Op.PULL, 7, 1, 0, CHUNK, client=1, seq=16, ref=ref, timeout=5.0))
            assert served.wait(10)
        finally:
            deliveries.stop()
        assert [req_id for req_id, _ in conn.answers] == [7]
        assert not broken
    finally:
        node.close()
        arena.close()


def test_looking_at_a_count_word_never_writes_it_back():
    """Whether a round is complete is read without the extent's lock (a parked sum's
    look, a pull deciding to wait); such a read must not store what it read, or an
    arrival counted under the lock between its read and its store is lost and the
    round never completes. A reader races a locked counter with the thread switch
    interval at its shortest; every count must survive."""
    arena = Arena(16 << 20)
    counts = 20_000
    interval = sys.getswitchinterval()
    try:
        extent = arena.reserve(1, UID, 4 * CHUNK)
        stop = threading.Event()

        def look() -> None:
            while not stop.is_set():
                collective_ops._word(extent, WORD)

        reader = threading.Thread(target=look)
        sys.setswitchinterval(1e-6)
        reader.start()
        try:
            for _ in range(counts):
                with extent.lock, extent.data[WORD:WORD + 8] as count:
                    kernels.fetch_add(count, 1)
        finally:
            stop.set()
            reader.join()
        assert int.from_bytes(extent.data[WORD:WORD + 8], "little") == counts
    finally:
        sys.setswitchinterval(interval)
        arena.close()


def test_a_sum_in_a_wire_type_is_narrowed_once_and_sent_to_every_party():
    """A round of bfloat16 pushes into a float32 slot: the round's first pull rounds the
    sum to bfloat16, every party gets those same bytes, and the narrowed copy goes when
    the round's last pull is counted."""
    parties, n = 3, CHUNK // 4
    arena = Arena(16 << 20)
    node = Node(arena, SECRET)
    try:
        extent = arena.reserve(1, UID, 4 * CHUNK)
        engine = Engine(node)
        token = tickets.sign(SECRET, UID, [1], "rw", ttl=600.0)[0]
        values = [np.full(n, 1.0 + i / 3, np.float32) for i in range(parties)]
        peers = [PeerDouble(SECRET, token, bf16_bits(v).tobytes()) for v in values]
        code = ChunkTypes(DType.FLOAT32, DType.BFLOAT16).code()
        ref = ChunkRound(WORD, parties, 0)
        reduces = [Reduce(Op.REDUCE, 5, 1, 0, n * 2, client=10 + i, seq=2, dtype=code, ref=ref, timeout=5.0)
                   for i in range(parties)]
        for peer, req in zip(peers, reduces, strict=True):
            engine.handle(peer, req)
        sent = []
        for i, (peer, req) in enumerate(zip(peers, reduces, strict=True)):
            engine.deliver(peer, req.pull())
            sent.append(peer.answers[-1][1])
            assert (0 in extent.narrowed) == (i < parties - 1)
        want = bf16_bits(sum(np.float32(bf16_value(v)) for v in values)).tobytes()
        assert sent == [want] * parties
    finally:
        node.close()
        arena.close()


def bf16_bits(values: np.ndarray) -> np.ndarray:
    out = np.empty(len(values), np.uint16)
    narrow(np.asarray(values, np.float32), DType.BFLOAT16, out)
    return out


def bf16_value(values: np.ndarray) -> np.ndarray:
    wide = np.empty(len(values), np.float32)
    widen(bf16_bits(values), DType.BFLOAT16, wide)
    return wide
