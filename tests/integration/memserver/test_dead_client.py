"""A client that vanishes in the middle of a request without a word (its host, link or
socket gone: no FIN, no RST reaches the memory server) must not hold what that request
holds (its exactly-once entry, its scratch) until the frame deadline: the client's
retry of the same numbered request waits for that entry. The memory server's kernel
finds the silent peer with keepalive probes within ``tcp_dead_peer_seconds``.

The silence is real: inside a network namespace of its own (:mod:`tests.integration.blackhole`)
the client sends half of a numbered ACCUMULATE, TCP to the plane's port is cut off, the
client's socket is reset (the RST is dropped by the cut, so the server never hears of
it) and the cut is lifted. The same request then comes again on a new connection, as
a client retries after its kernel gave a connection up.
"""
from __future__ import annotations

import fcntl
import json
import socket
import struct
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration import blackhole

MiB = 1 << 20
SECRET = b"d" * 32
UID = "dead-client-region"
CLIENT, SEQ = 0x5EED, 7
FRAME_TIMEOUT = 30.0    # the plane's frame deadline: what the retry waited for before
DEAD_PEER = 1.0         # the plane's tcp_dead_peer_seconds here


def _unsent(sock: socket.socket) -> int:
    """Bytes ``sock`` has not had acknowledged yet (sent or queued)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0]


def vanishing(workdir: str) -> dict[str, object]:
    """Inside the namespace: a plane, a client that vanishes mid-request, its retry."""
    from smb_client.transports.tcp import TcpConnection
    from smb_protocol import tickets
    from smb_protocol.dtypes import DType
    from smb_protocol.wire import Op
    from smb_server.memserver.arena import Arena
    from smb_server.memserver.node import Node
    from smb_server.memserver.tcp_plane import TcpPlane
    from tests.integration.memserver.planes import typed

    blackhole.lo_up()
    facts: dict[str, object] = {}
    arena = Arena(64 * MiB)
    arena.reserve(1, UID, 8 * MiB)
    token = tickets.sign(SECRET, UID, [1], "rw", ttl=600.0)[0]
    n = MiB // 8             # the whole request fits the socket buffers, as a retry's does
    ones = np.ones(n, dtype=np.int64)
    req = typed(Op.ACCUMULATE, 1, 0, MiB, int(DType.INT64), client=CLIENT, seq=SEQ)
    try:
        with TcpPlane(Node(arena, SECRET), frame_timeout=FRAME_TIMEOUT, dead_peer_timeout=DEAD_PEER) as plane:
            connection = TcpConnection("127.0.0.1", plane.port)
            connection.present(token)
            first = connection.sock
            # half the payload, all of it taken in by the server's kernel
            first.sendall(req.to_frame(2) + memoryview(ones)[: n // 2].cast("B"))
            deadline = time.monotonic() + 10
            while _unsent(first) and time.monotonic() < deadline:
                time.sleep(0.01)
            facts["unsent"] = _unsent(first)
            blackhole.block(plane.port)
            first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            first.close()             # a reset that the cut drops: the server hears nothing
            blackhole.unblock()
            # (patient: on Linux, TCP_USER_TIMEOUT also ends a connection whose peer keeps
            # its window shut, as the server does while the retry waits for the entry)
            retry = TcpConnection("127.0.0.1", plane.port, io_timeout=2 * FRAME_TIMEOUT,
                                  dead_peer_timeout=2 * FRAME_TIMEOUT)
            retry.present(token)
            start = time.monotonic()
            retry.request(req, [memoryview(ones).cast("B")])
            facts["retry_seconds"] = time.monotonic() - start
            got = np.frombuffer(bytes(arena.get(1).data[:MiB]), dtype=np.int64)
            facts["applied_once"] = bool(np.array_equal(got, ones))
            retry.close()
    finally:
        arena.close()
    return facts


@pytest.mark.timeout(120)
def test_a_client_gone_silent_mid_request_frees_its_entry_for_the_retry(tmp_path):
    facts, where = blackhole.run_in_namespace("tests.integration.memserver.test_dead_client",
                                              "vanishing", tmp_path, timeout=100)
    assert facts["unsent"] == 0, where
    # the retry waited for the silent connection's end: the dead-peer time and a probe,
    # not the frame deadline (it took FRAME_TIMEOUT before the plane probed its clients)
    assert facts["retry_seconds"] < FRAME_TIMEOUT / 3, where
    assert facts["applied_once"], where      # the half taken in is not added twice


if __name__ == "__main__":   # inside the namespace (see the test)
    mode, workdir, out = sys.argv[1:4]
    Path(out).write_text(json.dumps({"vanishing": vanishing}[mode](workdir)))
