"""The data planes' listener on its own, over real sockets: TCP on 127.0.0.1 and a Unix
socket in a temporary directory (admission, refusals, EMFILE, close)."""
from __future__ import annotations

import os
import resource
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from smb_protocol import tickets
from smb_protocol.errors import ServerBusy, SMBError, Status
from smb_server.memserver.arena import Arena
from smb_server.memserver.listener import Listener
from smb_server.memserver.node import Node
from smb_server.memserver.shm_plane import ANSWER_HEAD, EXTENT_ID, REQUEST_HEAD, ShmPlane
from smb_server.memserver.stats import PlaneStats
from smb_server.testing import wait_until

ROOT = Path(__file__).resolve().parents[3]
WAIT = 5.0  # seconds any one condition below may take


def echo(sock: socket.socket, peer: str) -> None:
    """Serve one connection: send back what arrives until the peer closes."""
    while data := sock.recv(1 << 16):
        sock.sendall(data)


def refusal(err: SMBError) -> bytes:
    return b"BUSY " + str(err).encode()


def connect(address: tuple[str, int] | str) -> socket.socket:
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(WAIT)
        sock.connect(address)
    else:
        sock = socket.create_connection(address, timeout=WAIT)
    return sock


def round_trip(sock: socket.socket, data: bytes = b"ping") -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        more = sock.recv(len(data) - len(got))
        if not more:
            break
        got += more
    return got


def read_all(sock: socket.socket) -> bytes:
    """Everything until the listener closes the connection."""
    out = b""
    while more := sock.recv(1 << 16):
        out += more
    return out



@pytest.fixture(params=["tcp", "unix"])
def address(request, tmp_path) -> tuple[str, int] | str:
    return ("127.0.0.1", 0) if request.param == "tcp" else str(tmp_path / "plane.sock")


def test_serves_each_connection_on_its_own_thread_and_closes_them_all(address):
    stats = PlaneStats("test")
    listener = Listener(address, echo, name="test", stats=stats)
    target = listener.address
    socks = [connect(target) for _ in range(3)]
    for i, sock in enumerate(socks):
        assert round_trip(sock, b"hello %d" % i) == b"hello %d" % i
    wait_until(lambda: listener.connections == 3, "three connections", WAIT)
    assert stats.snapshot()["sessions"] == 3
    listener.close(timeout=WAIT)
    assert listener.closing and listener.connections == 0
    for sock in socks:                       # shut down by close()
        assert sock.recv(1) == b""
        sock.close()
    assert stats.snapshot()["sessions"] == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("test-") and t.is_alive()]
    with pytest.raises(OSError):
        connect(target)
    listener.close()                         # idempotent


def test_tcp_address_and_port():
    with Listener(("127.0.0.1", 0), echo, name="test") as listener:
        host, port = listener.address
        assert host == "127.0.0.1" and port == listener.port > 0
        with connect(listener.address) as sock:
            assert round_trip(sock) == b"ping"


def test_unix_socket_file_is_private_replaces_a_stale_one_and_is_removed(tmp_path):
    path = tmp_path / "plane.sock"
    path.write_bytes(b"left by a previous run")
    with Listener(str(path), echo, name="test") as listener:
        assert listener.port == 0 and listener.address == str(path)
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with connect(str(path)) as sock:
            assert round_trip(sock) == b"ping"
    assert not path.exists()


def refuses_a_third(listener: Listener, stats: PlaneStats) -> str:
    """Two connections to ``listener`` are served, a third is refused (counted once in
    ``stats``) while the two keep working, and once one of them closes a new one is
    served again. Returns the refused connection's answer."""
    held = [connect(listener.address) for _ in range(2)]
    try:
        for sock in held:
            assert round_trip(sock) == b"ping"
        with connect(listener.address) as extra:
            answer = read_all(extra).decode()
        assert stats.limits()["refused"] == 1
        assert round_trip(held[0]) == b"ping"           # the others keep working
        held.pop().close()
        wait_until(lambda: listener.connections == 1, "the closed connection to go", WAIT)
        with connect(listener.address) as again:
            assert round_trip(again) == b"ping"
    finally:
        for sock in held:
            sock.close()
    return answer


def test_full_listener_refuses_with_the_planes_answer_then_admits_again(address):
    stats = PlaneStats("test")
    with Listener(address, echo, name="test", stats=stats, max_connections=2,
                  refusal=refusal, max_setting="test_connections_max") as listener:
        answer = refuses_a_third(listener, stats)
    assert answer.startswith("BUSY ") and "full" in answer
    assert "test_connections_max" in answer


def test_per_peer_limit_counts_connections_from_one_address():
    stats = PlaneStats("test")
    with Listener(("127.0.0.1", 0), echo, name="test", stats=stats, max_per_peer=2,
                  refusal=refusal, per_peer_setting="test_connections_per_peer") as listener:
        answer = refuses_a_third(listener, stats)
    assert "127.0.0.1" in answer and "test_connections_per_peer" in answer


def test_admission_callback_can_refuse(address):
    seen: list[str] = []

    def admit(peer: str) -> SMBError | None:
        seen.append(peer)
        return ServerBusy("not now") if len(seen) == 1 else None

    with Listener(address, echo, name="test", refusal=refusal, admit=admit) as listener:
        with connect(listener.address) as first:
            assert read_all(first) == b"BUSY not now"
        with connect(listener.address) as second:
            assert round_trip(second) == b"ping"
    assert seen[0] == ("127.0.0.1" if isinstance(address, tuple) else f"uid {os.getuid()}")


def test_a_failing_connection_is_closed_and_the_listener_keeps_serving(address):
    stats = PlaneStats("test")

    def serve(sock: socket.socket, peer: str) -> None:
        if sock.recv(4) == b"boom":
            raise RuntimeError("a bug in the plane")
        sock.sendall(b"fine")

    with Listener(address, serve, name="test", stats=stats) as listener:
        with connect(listener.address) as bad:
            bad.sendall(b"boom")
            assert read_all(bad) == b""
        with connect(listener.address) as good:
            assert round_trip(good, b"okay") == b"fine"
        wait_until(lambda: listener.connections == 0, "both connections to end", WAIT)
    assert stats.snapshot()["errors"] == 1 and stats.snapshot()["sessions"] == 0


def test_close_waits_for_connections_that_finish_on_shutdown(address):
    ended = threading.Event()

    def serve(sock: socket.socket, peer: str) -> None:
        sock.sendall(b"hi")
        sock.recv(1)            # returns once close() shuts the socket down
        ended.set()

    listener = Listener(address, serve, name="test")
    sock = connect(listener.address)
    assert sock.recv(2) == b"hi"
    listener.close(timeout=WAIT)
    assert ended.is_set()
    sock.close()


CHILD = r"""
import os, socket, sys
from smb_server.memserver.listener import Listener

def serve(sock, peer):
    while data := sock.recv(1 << 16):
        sock.sendall(data)

address = sys.argv[1] if sys.argv[1] != "tcp" else ("127.0.0.1", 0)
listener = Listener(address, serve, name="child", refusal=lambda err: b"BUSY " + str(err).encode())
hog = []
while True:                     # use every descriptor left
    try:
        hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
print(listener.port, flush=True)
sys.stdin.readline()            # then give some back
for fd in hog[:8]:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
listener.close()
"""


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_accept_survives_emfile_refuses_clearly_and_serves_once_descriptors_free(kind, tmp_path):
    path = str(tmp_path / "child.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path if kind == "unix" else "tcp"], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line, f"the child exited with {proc.wait(10)}"
        address = path if kind == "unix" else ("127.0.0.1", int(line))
        for _ in range(3):       # refused each time, and the loop goes on
            with connect(address) as sock:
                answer = read_all(sock).decode()
            assert answer.startswith("BUSY ") and "file descriptors" in answer
            assert "LimitNOFILE" in answer
        assert proc.poll() is None
        proc.stdin.write("free\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "freed\n"
        with connect(address) as sock:
            assert round_trip(sock) == b"ping"
    finally:
        proc.communicate("\n", timeout=20)
    assert proc.returncode == 0


def shm_attach(sock: socket.socket, token: str, extent_id: int) -> int:
    """Ask the shm plane for an extent's descriptor; the answer's status (the descriptor,
    when one comes, is closed)."""
    raw = token.encode()
    sock.sendall(REQUEST_HEAD.pack(len(raw)) + raw + EXTENT_ID.pack(extent_id))
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
    for fd in fds:
        os.close(fd)
    return ANSWER_HEAD.unpack_from(msg)[0]


def test_shm_plane_refuses_over_its_limit_with_a_server_busy_answer(tmp_path):
    arena = Arena(1 << 20)
    arena.reserve(1, "shm-limit", 4096)
    path = str(tmp_path / "shm.sock")
    try:
        with ShmPlane(Node(arena, bytes(32)), path, max_connections=1) as plane:
            with connect(path) as held:
                token = tickets.sign(bytes(32), "shm-limit", [1], "rw", ttl=60.0)[0]
                assert shm_attach(held, token, 1) == Status.OK   # counted from its valid ticket
                with connect(path) as extra:
                    answer = read_all(extra)
                status, n = ANSWER_HEAD.unpack_from(answer)
                assert status == Status.SERVER_BUSY
                assert "full" in answer[ANSWER_HEAD.size:ANSWER_HEAD.size + n].decode()
                assert plane.stats.limits()["refused"] == 1
                assert held.fileno() >= 0
        assert not os.path.exists(path)
    finally:
        arena.close()


def test_refused_counts_reach_a_shared_root():
    root = PlaneStats()
    with Listener(("127.0.0.1", 0), echo, name="test", stats=root.for_transport("test"),
                  max_connections=0, refusal=refusal) as listener:
        with connect(listener.address) as sock:
            assert b"full" in read_all(sock)
    assert root.limits()["refused"] == 1
    assert root.for_transport("test").limits()["refused"] == 1


# -- unauthenticated connections: a budget of their own ------------------------------

def greeter(listener: list[Listener]):
    """A serve function whose connections authenticate by sending ``auth``, then echo;
    ``listener[0]`` is the listener that serves it."""
    def serve(sock: socket.socket, peer: str) -> None:
        if sock.recv(4) != b"auth":
            return
        try:
            listener[0].current().authenticated()
        except ServerBusy as exc:
            sock.sendall(b"BUSY " + str(exc).encode())
            return
        sock.sendall(b"ok")
        echo(sock, peer)
    return serve


def authenticate(sock: socket.socket) -> bytes:
    """Authenticate with a greeter: b"ok", or the start of a refusal."""
    sock.sendall(b"auth")
    got = b""
    while len(got) < 2 and (more := sock.recv(2 - len(got))):
        got += more
    return got


def connect_from(listener: Listener, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(WAIT)
    sock.connect(listener.address)
    return sock


def test_unauthenticated_connections_have_a_budget_of_their_own_and_the_oldest_is_evicted(address):
    stats = PlaneStats("test")
    ref: list[Listener] = []
    with Listener(address, greeter(ref), name="test", stats=stats, max_connections=4,
                  max_per_peer=4, max_unauthenticated=3, refusal=refusal,
                  unauthenticated_setting="test_unauthenticated") as listener:
        ref.append(listener)
        authed = [connect(listener.address) for _ in range(2)]
        for sock in authed:
            assert authenticate(sock) == b"ok"
        wait_until(lambda: listener.unauthenticated == 0, "both to authenticate", WAIT)
        idle = []
        for i in range(3):                      # fill the budget; nothing is evicted yet
            idle.append(connect(listener.address))
            wait_until(lambda n=i + 1: listener.unauthenticated == n, f"idle connection {i}", WAIT)
        for i in range(20):                     # each newer one evicts the oldest idle one
            idle.append(connect(listener.address))
            wait_until(lambda n=i + 1: stats.limits()["evicted"] == n, f"eviction {i}", WAIT)
            answer = read_all(idle[i]).decode()
            assert answer.startswith("BUSY ") and "test_unauthenticated" in answer
            assert "before it authenticated" in answer
        assert listener.unauthenticated == 3
        for sock in authed:                     # never counted against that budget
            assert round_trip(sock, b"still here") == b"still here"
        late = connect(listener.address)        # evicts one idle connection, then authenticates
        assert authenticate(late) == b"ok"
        assert round_trip(late) == b"ping"
        assert stats.limits()["refused"] == 0
        for sock in [*authed, *idle, late]:
            sock.close()


def test_authenticated_connections_keep_the_per_peer_limit(address):
    stats = PlaneStats("test")
    ref: list[Listener] = []
    with Listener(address, greeter(ref), name="test", stats=stats, max_per_peer=2,
                  max_unauthenticated=8, refusal=refusal,
                  per_peer_setting="test_connections_per_peer") as listener:
        ref.append(listener)
        first = connect(listener.address)
        assert authenticate(first) == b"ok"
        waiting = [connect(listener.address) for _ in range(2)]   # admitted: one slot left
        wait_until(lambda: listener.unauthenticated == 2, "two waiting connections", WAIT)
        assert authenticate(waiting[0]) == b"ok"
        answer = round_trip(waiting[1], b"auth") + read_all(waiting[1])
        assert answer.startswith(b"BUSY ") and b"test_connections_per_peer" in answer
        with connect(listener.address) as extra:   # the peer's share is full: refused at once
            answer = read_all(extra)
        assert answer.startswith(b"BUSY ") and b"test_connections_per_peer" in answer
        assert stats.limits()["refused"] == 2
        first.close()                               # waiting[0] is left
        wait_until(lambda: listener.connections == 1, "the closed connections to go", WAIT)
        with connect(listener.address) as again:
            assert authenticate(again) == b"ok"
        for sock in [first, *waiting]:
            sock.close()


def test_the_peer_holding_the_most_unauthenticated_connections_is_evicted_first():
    stats = PlaneStats("test")
    ref: list[Listener] = []
    with Listener(("127.0.0.1", 0), greeter(ref), name="test", stats=stats,
                  max_unauthenticated=3, refusal=refusal) as listener:
        ref.append(listener)
        mine = connect_from(listener, "127.0.0.1")
        wait_until(lambda: listener.unauthenticated == 1, "the first connection", WAIT)
        flood = []
        for i in range(10):       # another address opens many more; only its own are evicted
            flood.append(connect_from(listener, "127.0.0.2"))
            evicted = max(0, i - 1)
            wait_until(lambda n=evicted: stats.limits()["evicted"] == n, f"connection {i}", WAIT)
        assert listener.unauthenticated == 3
        for sock in flood[:8]:
            assert read_all(sock).startswith(b"BUSY ")
        assert authenticate(mine) == b"ok"        # the oldest of all, yet never evicted
        assert round_trip(mine) == b"ping"
        for sock in [mine, *flood]:
            sock.close()


def test_current_is_only_known_on_a_connections_thread():
    with Listener(("127.0.0.1", 0), echo, name="test") as listener:
        with pytest.raises(RuntimeError, match="outside a connection's thread"):
            listener.current()
