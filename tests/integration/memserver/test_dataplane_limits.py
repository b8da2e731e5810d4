"""Limits of the memory server's TCP data plane, against real planes and real sockets
on loopback: HELLO and frame deadlines, connections per peer and in all, clear
refusals, shared scratch buffers, one descriptor per extent, a child process serving
an arena and a tcp plane under a low ``RLIMIT_NOFILE``, and real ``smb server``
processes configured through the environment.

An "attacker" connects from 127.0.0.2 (any 127/8 address is loopback on Linux) and the
legitimate client from 127.0.0.1, so the per-peer limit tells them apart.
"""
from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from smb_client.transports.tcp import TcpConnection, TcpSession
from smb_protocol import tickets, wire
from smb_protocol.addressing import parse_endpoint
from smb_protocol.dtypes import DType
from smb_protocol.errors import InvalidTicket, ServerBusy, ServerUnavailable, Status
from smb_protocol.wire import Op
from smb_server.commands.local_cluster import LocalCluster
from smb_server.memserver.arena import Arena
from smb_server.memserver.node import Node
from smb_server.memserver.scratch import SCRATCH_BYTES
from smb_server.memserver.stats import PlaneStats
from smb_server.memserver.tcp_plane import TcpPlane
from smb_server.runtime.certs import make_cluster_certs
from tests.integration.memserver.planes import typed

SECRET = b"k" * 32
UID = "limits-region"
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[3]
ATTACKER = "127.0.0.2"


def ticket(extent_ids: list[int]) -> str:
    return tickets.sign(SECRET, UID, extent_ids, "rw", ttl=600.0)[0]


def attacker_socket(port: int, source: str = ATTACKER) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def refusal(sock: socket.socket) -> tuple[int, str]:
    """The unsolicited answer of a refused connection: (status, message)."""
    status, req_id, n = wire.unpack_response(wire.recv_exact(sock, wire.RESPONSE.size))
    assert req_id == 0
    return status, bytes(wire.recv_exact(sock, n)).decode()


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``sock``; fails after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for more than {seconds} s")
    return time.monotonic() - start


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hello(sock: socket.socket, token: str) -> int:
    raw = token.encode()
    wire.sendmsg_all(sock, [wire.pack_request(Op.HELLO, 1, length=len(raw)), raw])
    status, _req, n = wire.unpack_response(wire.recv_exact(sock, wire.RESPONSE.size))
    wire.recv_exact(sock, n)
    return status


@pytest.fixture
def arena():
    a = Arena(64 * MiB)
    a.reserve(1, UID, 8 * MiB)
    yield a
    a.close()


def session(port: int) -> TcpSession:
    return TcpSession(parse_endpoint(f"tcp://127.0.0.1:{port}"), {"io_timeout": 10})


def test_idle_connections_without_hello_are_dropped(arena):
    with TcpPlane(Node(arena, SECRET), max_connections=8, max_per_peer=4, hello_timeout=0.5) as plane:
        idle = [attacker_socket(plane.port) for _ in range(4)]
        for sock in idle:
            status, message = refusal(sock)           # a parting answer, then the close
            assert status == Status.TIMEOUT and "tcp_hello_timeout_seconds" in message
            assert closed_within(sock, 5) < 3
            sock.close()
        assert plane.stats.limits()["dropped"] >= 4
        deadline = time.monotonic() + 5
        while plane.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert plane.connections == 0


def test_hello_trickled_byte_by_byte_misses_its_deadline(arena):
    with TcpPlane(Node(arena, SECRET), hello_timeout=1.0, frame_timeout=30.0) as plane:
        sock = attacker_socket(plane.port)
        raw = ticket([1]).encode()
        frame = wire.pack_request(Op.HELLO, 1, length=len(raw)) + raw
        start = time.monotonic()
        with pytest.raises(OSError):
            for i in range(len(frame)):          # one byte every 0.1 s: each recv makes progress
                sock.send(frame[i:i + 1])
                time.sleep(0.1)
                if time.monotonic() - start > 10:
                    pytest.fail("a trickled HELLO was never dropped")
            closed_within(sock, 0.1)
            raise OSError("dropped at the end")
        assert time.monotonic() - start < 5
        sock.close()


def test_frame_must_arrive_whole_within_its_deadline(arena):
    with TcpPlane(Node(arena, SECRET), frame_timeout=1.0) as plane:
        sock = attacker_socket(plane.port, "127.0.0.1")
        assert hello(sock, ticket([1])) == Status.OK
        sock.send(wire.pack_request(Op.WRITE, 2, 1, 0, 1000))
        start = time.monotonic()
        for _ in range(100):                      # one payload byte every 0.1 s
            sock.send(b"x")
            if select.select([sock], [], [], 0.1)[0]:
                break
        assert time.monotonic() - start < 4
        status, message = refusal(sock)          # the parting answer says what happened
        assert status == Status.TIMEOUT
        assert "tcp_frame_timeout_seconds" in message and "slow links" in message
        assert closed_within(sock, 5) < 3
        # an idle connection with a ticket is left alone between frames
        other = TcpConnection("127.0.0.1", plane.port)
        other.present(ticket([1]))
        time.sleep(1.5)
        assert other.request(typed(Op.PING)) == b""
        other.close()
        sock.close()


def test_per_peer_limit_refuses_clearly_and_others_keep_working(arena):
    with TcpPlane(Node(arena, SECRET), max_connections=16, max_per_peer=3, hello_timeout=30) as plane:
        held = [attacker_socket(plane.port) for _ in range(5)]
        for sock in held:                         # slowloris: a byte now and then, never a frame
            sock.send(b"\x42")
        # those are not counted against the per-peer limit; connections with a ticket are
        authed = [attacker_socket(plane.port) for _ in range(3)]
        for sock in authed:
            assert hello(sock, ticket([1])) == Status.OK
        extra = attacker_socket(plane.port)
        status, message = refusal(extra)
        assert status == Status.SERVER_BUSY
        assert ATTACKER in message and "tcp_connections_per_peer" in message
        assert extra.recv(1) == b""
        extra.close()
        # the legitimate client, through the real client transport
        s = session(plane.port)
        data = np.arange(1024, dtype=np.float32)
        s.write(ticket([1]), 1, 0, [memoryview(data).cast("B")])
        back = np.zeros_like(data)
        s.read_into(ticket([1]), 1, 0, [memoryview(back).cast("B")])
        assert np.array_equal(back, data)
        s.close()
        assert plane.stats.limits()["refused"] == 1
        for sock in held + authed:
            sock.close()


def test_full_server_refuses_with_a_typed_error(arena):
    with TcpPlane(Node(arena, SECRET), max_connections=3, max_per_peer=3, hello_timeout=30) as plane:
        held = [TcpConnection("127.0.0.1", plane.port) for _ in range(3)]
        for conn in held:
            conn.present(ticket([1]))
        refused = TcpConnection("127.0.0.1", plane.port)
        with pytest.raises(ServerBusy) as info:
            refused.present(ticket([1]))
        assert isinstance(info.value, ServerUnavailable)    # retry policies treat it alike
        assert "full" in str(info.value) and "tcp_connections_max" in str(info.value)
        # a first request too big for the socket buffers: its send fails, the refusal is read
        big = TcpConnection("127.0.0.1", plane.port)
        payload = memoryview(bytearray(32 * MiB))
        with pytest.raises(ServerBusy, match="tcp_connections_max"):
            big.request(typed(Op.WRITE, 1, 0, len(payload)), [payload])
        held[0].close()
        deadline = time.monotonic() + 5
        while plane.connections >= 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        again = TcpConnection("127.0.0.1", plane.port)
        again.present(ticket([1]))
        assert again.request(typed(Op.PING)) == b""
        for conn in [*held[1:], again]:
            conn.close()


def test_scratch_buffers_are_shared_and_bounded(arena):
    n = 6 * MiB // 4
    ones = np.ones(n, dtype=np.float32)
    stats = PlaneStats("tcp")
    with TcpPlane(Node(arena, SECRET), stats=stats, scratch_bytes=SCRATCH_BYTES) as plane:
        conns = [TcpConnection("127.0.0.1", plane.port) for _ in range(4)]
        errors: list[BaseException] = []

        def add(conn: TcpConnection) -> None:
            try:
                conn.present(ticket([1]))
                conn.request(typed(Op.ACCUMULATE, 1, 0, n * 4, dtype=DType.FLOAT32), [memoryview(ones).cast("B")])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=add, args=(c,)) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
        assert np.all(arena.get(1).array(np.float32, 0, n * 4) == 4.0)
        limits = stats.limits()
        assert plane.scratch.allocated <= SCRATCH_BYTES           # one buffer for 4 connections
        assert limits["scratch_bytes"] == plane.scratch.allocated
        assert limits["scratch_in_use"] == 0                       # nothing kept by idle connections
        for c in conns:
            c.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_request_waiting_longer_than_the_dead_peer_time_is_not_taken_for_a_dead_server(arena, tmp_path, tls):
    """The only scratch buffer is held by a client whose payload trickles; another
    client's accumulate waits for it, with the server's receive window shut for three
    times the waiting client's dead-peer time. Linux would end that connection as if the
    server were gone (TCP_USER_TIMEOUT counts a shut window): it must wait and succeed
    (over TLS, the write that timed out is made again)."""
    n = 8 * MiB // 4
    ones = memoryview(np.ones(n, dtype=np.float32)).cast("B")
    req = typed(Op.ACCUMULATE, 1, 0, n * 4, dtype=DType.FLOAT32)
    certs = make_cluster_certs(str(tmp_path / "ca")) if tls else None
    client = certs.client().client_context() if certs else None
    with TcpPlane(Node(arena, SECRET), scratch_bytes=SCRATCH_BYTES,
                  tls=certs.daemon().server_context() if certs else None) as plane:
        slow = TcpConnection("127.0.0.1", plane.port, tls=client)
        slow.present(ticket([1]))
        slow.sock.sendall(req.to_frame(7) + ones[:MiB])    # holds the scratch buffer
        waiting = TcpConnection("127.0.0.1", plane.port, io_timeout=30, dead_peer_timeout=1.0, tls=client)
        waiting.present(ticket([1]))
        outcome: list[object] = []

        def add() -> None:
            try:
                outcome.append(waiting.request(req, [ones]))
            except Exception as exc:  # noqa: BLE001 - the outcome the test looks at
                outcome.append(exc)
        worker = threading.Thread(target=add)
        worker.start()
        worker.join(3.0)                      # three dead-peer times, the window shut
        assert worker.is_alive(), outcome     # still waiting for the scratch buffer
        slow.sock.sendall(ones[MiB:])
        status, req_id, length = wire.unpack_response(wire.recv_exact(slow.sock, wire.RESPONSE.size))
        assert (status, req_id, length) == (Status.OK, 7, 0)
        worker.join(30)
        assert outcome == [b""]               # answered, not ServerUnavailable
        assert np.all(arena.get(1).array(np.float32, 0, n * 4) == 2.0)
        assert not waiting.sender.lifted      # the user timeout is back once the answer came
        assert waiting.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1000
        waiting.close()
        slow.close()


def test_an_extent_costs_one_descriptor():
    a = Arena(64 * MiB)
    try:
        before = open_fds()
        for i in range(10):
            a.reserve(100 + i, UID, MiB)
        assert open_fds() - before == 10
    finally:
        a.close()


CHILD = r"""
import json, resource, socket, sys, time
from smb_protocol.errors import OutOfMemory
from smb_server.memserver.arena import Arena
from smb_server.memserver.memmap import raise_fd_limit
from smb_server.memserver.tcp_plane import TcpPlane
from smb_server.memserver.node import Node

soft, hard = raise_fd_limit()
arena = Arena(1 << 30, fd_reserve=int(sys.argv[1]))
made, error = 0, ""
try:
    for i in range(10_000):
        arena.reserve(i, "limits-region", 4096)
        made += 1
except OutOfMemory as exc:
    error = str(exc)
for i in range(int(sys.argv[2])):
    arena.release(i)           # give back a few descriptors
plane = TcpPlane(Node(arena, bytes(32)), max_connections=10_000, max_per_peer=10_000, hello_timeout=60)
print(json.dumps({"soft": soft, "hard": hard, "made": made, "error": error,
                  "port": plane.port}), flush=True)
sys.stdin.read()
plane.close()
"""


def child_server(nofile: int, fd_reserve: int, free: int) -> tuple[subprocess.Popen[str], dict]:
    """A child process serving a memory server's arena and tcp plane under
    ``RLIMIT_NOFILE`` = ``nofile`` (soft and hard), after it made extents until refused
    and released ``free`` of them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(fd_reserve), str(free)], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited with {proc.wait(10)}"
    return proc, json.loads(line)


def test_low_descriptor_limit_refuses_extents_before_running_out():
    proc, info = child_server(nofile=200, fd_reserve=32, free=0)
    try:
        assert info["soft"] == info["hard"] == 200
        assert 100 < info["made"] < 200 - 32
        assert "file descriptors" in info["error"] and "LimitNOFILE" in info["error"]
        # the server still has descriptors for clients
        conn = TcpConnection("127.0.0.1", info["port"])
        with pytest.raises(InvalidTicket):   # another secret: refused, but answered
            conn.present(ticket([0]))
        conn.close()
    finally:
        proc.communicate("", timeout=20)


def test_accept_loop_survives_emfile_and_keeps_serving():
    proc, info = child_server(nofile=64, fd_reserve=0, free=8)
    port = info["port"]
    try:
        # the child is nearly out of descriptors; connections fill what is left
        socks: list[socket.socket] = []
        busy = None
        for _ in range(64):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.settimeout(0.3)
            try:
                status, _req, n = wire.unpack_response(wire.recv_exact(s, wire.RESPONSE.size))
                busy = (status, bytes(wire.recv_exact(s, n)).decode())
                s.close()
                break
            except TimeoutError:
                socks.append(s)                  # accepted, waiting for its HELLO
        assert busy is not None, "no refusal once the server ran out of descriptors"
        assert busy[0] == Status.SERVER_BUSY and "file descriptors" in busy[1]
        assert proc.poll() is None
        # free some descriptors: new connections are served again
        for s in socks[:5]:
            s.close()
        time.sleep(0.5)
        conn = TcpConnection("127.0.0.1", port)
        assert conn.sock.fileno() >= 0
        conn.sock.settimeout(5)
        wire.sendmsg_all(conn.sock, [wire.pack_request(Op.HELLO, 1, length=3), b"bad"])
        status, _req, _n = wire.unpack_response(wire.recv_exact(conn.sock, wire.RESPONSE.size))
        assert status == Status.INVALID_TICKET       # answered: the loop is serving
        conn.close()
        for s in socks[5:]:
            s.close()
    finally:
        proc.communicate("", timeout=20)


def test_memory_server_daemon_keeps_clients_working_under_a_connection_flood(tmp_path):
    """A real ``smb server`` process configured through the environment: an attacker
    holding the whole unauthenticated budget and more idle connections has its oldest
    evicted and the others dropped, while a client keeps creating, writing and reading
    regions."""
    env = {"SMB_TCP_CONNECTIONS_UNAUTHENTICATED": "4", "SMB_TCP_HELLO_TIMEOUT_SECONDS": "1"}
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"),
                      transports="tcp", env=env, log_level="INFO") as cluster:
        with cluster.client() as client:
            (server,) = client.list_servers()
            port = int(next(e for e in server.endpoints if e.startswith("tcp://")).rpartition(":")[2])
            held = [attacker_socket(port) for _ in range(4)]
            held.append(attacker_socket(port))      # one more: the oldest is evicted
            status, message = refusal(held.pop(0))
            assert status == Status.SERVER_BUSY and "tcp_connections_unauthenticated" in message
            region = client.create_region("limits/flood", MiB)
            data = np.arange(MiB // 4, dtype=np.float32)
            region.write(0, data)
            back = np.zeros_like(data)
            region.read_into(0, back)
            assert np.array_equal(back, data)
            for sock in held:                       # no HELLO within 1 s: dropped
                assert closed_within(sock, 5) < 4
                sock.close()
            again = attacker_socket(port)           # the share is free again
            assert hello(again, "not a ticket") == Status.INVALID_TICKET
            again.close()
            client.delete_region("limits/flood")


def test_memory_server_daemon_raises_its_descriptor_limit(tmp_path):
    """``smb server`` lifts its RLIMIT_NOFILE soft limit to the hard one at start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env["SMB_SECRET"] = "ab" * 32
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smb_server.commands.cli", "server", "--controller", "127.0.0.1:1",
             "--state-dir", str(tmp_path / "state"), "--capacity", "16M", "--transports", "tcp"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024)))
    try:
        deadline = time.monotonic() + 30
        while b"descriptor limit" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (1024, 1024)
        assert "descriptor limit: 1024" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
