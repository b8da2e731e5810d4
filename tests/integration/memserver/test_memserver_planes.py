"""The memory server's data planes, driven in-process with raw sockets.

No controller: the test signs tickets with the shared secret itself. The last tests
run a whole :class:`MemoryServer` against a fake in-process controller.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from smb_protocol import rpc, tickets, wire
from smb_protocol._proto.smb.v1 import controller_pb2, controller_pb2_grpc, memory_server_pb2, memory_server_pb2_grpc
from smb_protocol.dtypes import DType
from smb_protocol.errors import (
    AuthenticationError,
    ExtentNotFound,
    InvalidArgument,
    InvalidTicket,
    OutOfMemory,
    PermissionDenied,
    Status,
)
from smb_protocol.wire import Op
from smb_server.memserver import access
from smb_server.memserver.arena import HEADER_BYTES, LIVE_OFFSET, Arena
from smb_server.memserver.main import MemoryServer
from smb_server.memserver.node import Node
from smb_server.memserver.shm_plane import ShmPlane
from smb_server.memserver.stats import PlaneStats
from smb_server.memserver.tcp_plane import TcpPlane
from smb_server.runtime.config import ServerConfig
from smb_server.runtime.grpc_util import make_server
from smb_server.testing import run_ranks

SECRET = b"s" * 32
UID = "region-1"
MiB = 1 << 20


class Raw:
    """A bare data-plane connection speaking wire.py by hand."""

    def __init__(self, port: int, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.ids = 0
        if token is not None:
            status, body = self.hello(token)
            assert status == Status.OK, body

    def hello(self, token: str) -> tuple[int, bytes]:
        raw = token.encode()
        return self.request(Op.HELLO, length=len(raw), payload=raw)

    def request(self, op: int, extent_id: int = 0, offset: int = 0, length: int = 0, dtype: int = 0,
                arg0: int = 0, arg1: int = 0, alpha: float = 0.0, payload: bytes = b"") -> tuple[int, bytes]:
        self.ids += 1
        wire.sendmsg_all(self.sock, [wire.pack_request(op, self.ids, extent_id, offset, length, dtype,
                                                       arg0, arg1, alpha), payload])
        status, req_id, n = wire.unpack_response(wire.recv_exact(self.sock, wire.RESPONSE.size))
        assert req_id == self.ids
        return status, bytes(wire.recv_exact(self.sock, n))

    def closed_by_server(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def ticket(extent_ids, mode="rw", uid=UID, secret=SECRET, ttl=600.0) -> str:
    return tickets.sign(secret, uid, extent_ids, mode, ttl=ttl)[0]


@pytest.fixture
def planes(tmp_path):
    arena = Arena(64 * MiB)
    stats = PlaneStats()
    node = Node(arena, SECRET)
    tcp = TcpPlane(node, "127.0.0.1", 0, stats)
    shm = ShmPlane(node, str(tmp_path / "shm.sock"), stats)
    arena.reserve(1, UID, MiB)
    arena.reserve(2, UID, MiB)
    arena.reserve(3, "other-region", 4096)
    yield arena, tcp, shm, stats
    tcp.close()
    shm.close()
    arena.close()


def test_hello_write_read_round_trip(planes):
    arena, tcp, _shm, stats = planes
    c = Raw(tcp.port, ticket([1, 2]))
    data = os.urandom(300_000)
    assert c.request(Op.WRITE, 1, 1000, len(data), payload=data) == (Status.OK, b"")
    assert c.request(Op.READ, 1, 1000, len(data)) == (Status.OK, data)
    assert bytes(arena.get(1).data[1000:1000 + len(data)]) == data
    assert c.request(Op.PING) == (Status.OK, b"")
    assert c.request(Op.READ, 1, 0, 0) == (Status.OK, b"")
    counts = stats.snapshot()
    assert counts["bytes_written"] == len(data) and counts["bytes_read"] == len(data)
    assert counts["sessions"] == 1 and counts["operations"] >= 4
    c.close()


def test_read_only_ticket_refuses_writes_and_stays_usable(planes):
    arena, tcp, _shm, _stats = planes
    arena.get(1).data[:4] = b"keep"
    c = Raw(tcp.port, ticket([1], mode="ro"))
    for op, kw in [(Op.WRITE, dict(length=4, payload=b"nope")),
                   (Op.ACCUMULATE, dict(length=8, dtype=DType.FLOAT32, payload=bytes(8))),
                   (Op.SCALE, dict(length=8, dtype=DType.FLOAT32, alpha=2.0)),
                   (Op.FETCH_ADD, dict(length=8, arg0=1))]:
        status, msg = c.request(op, 1, 0, **kw)
        assert status == Status.READ_ONLY, (op, msg)
        assert b"read-only" in msg
    assert c.request(Op.READ, 1, 0, 4) == (Status.OK, b"keep")
    c.close()


def test_forged_and_foreign_tickets(planes):
    _arena, tcp, _shm, _stats = planes
    c = Raw(tcp.port)
    status, msg = c.hello(ticket([1], secret=b"x" * 32))
    assert status == Status.INVALID_TICKET and b"signature" in msg
    assert c.closed_by_server()
    c = Raw(tcp.port)
    assert c.hello("not a ticket")[0] == Status.INVALID_TICKET
    c = Raw(tcp.port)
    assert c.hello(ticket([1], ttl=-5))[0] == Status.TICKET_EXPIRED

    c = Raw(tcp.port, ticket([1]))
    status, msg = c.request(Op.READ, 2, 0, 8)               # not named by the ticket
    assert status == Status.INVALID_TICKET and b"extent 2" in msg
    c2 = Raw(tcp.port, ticket([3]))                          # names extent 3, wrong region
    assert c2.request(Op.READ, 3, 0, 8)[0] == Status.EXTENT_NOT_FOUND
    assert c.request(Op.READ, 1, 0, 8) == (Status.OK, bytes(8))
    c.close()
    c2.close()


def test_ticket_expiring_on_an_open_connection(planes, monkeypatch):
    _arena, tcp, _shm, _stats = planes
    c = Raw(tcp.port, ticket([1], ttl=60))
    assert c.request(Op.READ, 1, 0, 8)[0] == Status.OK
    later = time.time() + 120                                 # the server's clock passes the expiry
    monkeypatch.setattr(access, "time", SimpleNamespace(time=lambda: later))
    assert c.request(Op.WRITE, 1, 0, 8, payload=bytes(8))[0] == Status.TICKET_EXPIRED
    fresh = tickets.sign(SECRET, UID, [1], "rw", ttl=60, now=later)[0]
    assert c.hello(fresh)[0] == Status.OK                     # a fresh ticket rebinds
    assert c.request(Op.READ, 1, 0, 8)[0] == Status.OK
    c.close()


def test_one_connection_carries_several_tickets_each_for_its_own_extents(planes):
    arena, tcp, _shm, _stats = planes
    arena.reserve(4, "region-b", 4096)
    c = Raw(tcp.port, ticket([1], mode="ro"))
    assert c.hello(ticket([4], uid="region-b"))[0] == Status.OK    # rw, another region
    assert c.request(Op.WRITE, 4, 0, 4, payload=b"bbbb") == (Status.OK, b"")
    status, msg = c.request(Op.WRITE, 1, 0, 4, payload=b"aaaa")     # b's rw ticket does not lend
    assert status == Status.READ_ONLY, msg
    assert c.request(Op.READ, 2, 0, 8)[0] == Status.INVALID_TICKET   # named by neither
    assert c.request(Op.READ, 1, 0, 4) == (Status.OK, bytes(4))
    assert c.hello(ticket([1]))[0] == Status.OK                      # rw for extent 1 beside the ro one
    assert c.request(Op.WRITE, 1, 0, 4, payload=b"aaaa") == (Status.OK, b"")
    assert c.hello(ticket([1], mode="ro"))[0] == Status.OK           # a renewed ro ticket takes
    assert c.request(Op.WRITE, 1, 0, 4, payload=b"cccc") == (Status.OK, b"")   # nothing from rw
    assert bytes(arena.get(1).data[:4]) == b"cccc" and bytes(arena.get(4).data[:4]) == b"bbbb"
    c.close()
    only_ro = Raw(tcp.port, ticket([1], mode="ro"))                 # a connection with ro alone
    assert only_ro.request(Op.WRITE, 1, 0, 4, payload=b"dddd")[0] == Status.READ_ONLY
    assert bytes(arena.get(1).data[:4]) == b"cccc"
    only_ro.close()


def test_released_extent_is_not_found(planes):
    arena, tcp, _shm, _stats = planes
    c = Raw(tcp.port, ticket([1, 2]))
    assert c.request(Op.WRITE, 1, 0, 4, payload=b"abcd")[0] == Status.OK
    arena.release(1)
    status, msg = c.request(Op.READ, 1, 0, 4)
    assert status == Status.EXTENT_NOT_FOUND and b"extent 1" in msg
    assert c.request(Op.WRITE, 1, 0, 4, payload=b"abcd")[0] == Status.EXTENT_NOT_FOUND
    assert c.request(Op.READ, 2, 0, 4) == (Status.OK, bytes(4))
    c.close()


def test_range_alignment_and_dtype_errors_keep_the_connection(planes):
    arena, tcp, _shm, _stats = planes
    snapshot = bytes(arena.get(2).data)
    c = Raw(tcp.port, ticket([1, 2]))
    cases = [
        (Status.OUT_OF_RANGE, dict(op=Op.WRITE, offset=MiB - 2, length=4, payload=b"wxyz")),
        (Status.OUT_OF_RANGE, dict(op=Op.READ, offset=MiB, length=1)),
        (Status.OUT_OF_RANGE, dict(op=Op.ACCUMULATE, offset=MiB - 4, length=8, dtype=DType.FLOAT32,
                                   payload=bytes(8))),
        (Status.MISALIGNED, dict(op=Op.ACCUMULATE, offset=2, length=8, dtype=DType.FLOAT32,
                                 payload=bytes(8))),
        (Status.MISALIGNED, dict(op=Op.AXPY, offset=0, length=6, dtype=DType.FLOAT32, alpha=1.0,
                                 payload=bytes(6))),
        (Status.MISALIGNED, dict(op=Op.FETCH_ADD, offset=4, length=8, arg0=1)),
        (Status.MISALIGNED, dict(op=Op.COMPARE_SWAP, offset=12, length=8)),
        (Status.DTYPE, dict(op=Op.ACCUMULATE, offset=0, length=8, dtype=DType.NONE, payload=bytes(8))),
        (Status.DTYPE, dict(op=Op.ACCUMULATE, offset=0, length=8, dtype=77, payload=bytes(8))),
        (Status.DTYPE, dict(op=Op.SCALE, offset=0, length=8, dtype=DType.INT32, alpha=2.0)),
        (Status.DTYPE, dict(op=Op.AXPY, offset=0, length=8, dtype=DType.INT64, alpha=2.0,
                            payload=bytes(8))),
    ]
    big = os.urandom(3 * MiB)   # a large payload that must be drained after the refusal
    cases.append((Status.OUT_OF_RANGE, dict(op=Op.WRITE, offset=0, length=len(big), payload=big)))
    for want, kw in cases:
        op = kw.pop("op")
        status, msg = c.request(op, 1, **kw)
        assert status == want, (op, kw.get("offset"), msg)
        assert msg
        assert c.request(Op.PING) == (Status.OK, b"")
    assert bytes(arena.get(2).data) == snapshot
    assert bytes(arena.get(1).data[MiB - 8:]) == bytes(8)
    c.close()


def test_vector_ops_and_atomics(planes):
    arena, tcp, _shm, _stats = planes
    c = Raw(tcp.port, ticket([1]))
    x = np.arange(1000, dtype=np.float32)
    assert c.request(Op.WRITE, 1, 64, x.nbytes, payload=x.tobytes())[0] == Status.OK
    assert c.request(Op.ACCUMULATE, 1, 64, x.nbytes, DType.FLOAT32, payload=x.tobytes())[0] == Status.OK
    assert c.request(Op.SCALE, 1, 64, x.nbytes, DType.FLOAT32, alpha=0.5)[0] == Status.OK
    assert c.request(Op.AXPY, 1, 64, x.nbytes, DType.FLOAT32, alpha=-2.0,
                     payload=np.ones(1000, np.float32).tobytes())[0] == Status.OK
    np.testing.assert_array_equal(arena.get(1).array(np.float32, 64, x.nbytes), x - 2)
    status, old = c.request(Op.FETCH_ADD, 1, 8192, 8, arg0=5)
    assert status == Status.OK and struct.unpack("<q", old)[0] == 0
    assert struct.unpack("<q", c.request(Op.FETCH_ADD, 1, 8192, 8, arg0=-9)[1])[0] == 5
    assert struct.unpack("<q", c.request(Op.COMPARE_SWAP, 1, 8192, 8, arg0=0, arg1=1)[1])[0] == -4
    assert struct.unpack("<q", c.request(Op.COMPARE_SWAP, 1, 8192, 8, arg0=-4, arg1=1)[1])[0] == -4
    assert arena.get(1).array("<i8", 8192, 8)[0] == 1
    c.close()


def test_concurrent_accumulate_is_exact(planes):
    arena, tcp, _shm, stats = planes
    n = 5 * MiB // 8              # int64 elements: each request spans two 4 MiB scratch chunks
    extent = arena.reserve(10, UID, n * 8)
    token = ticket([10])
    rounds, workers = 3, 4

    def work(k: int) -> None:
        c = Raw(tcp.port, token)
        payload = np.full(n, k + 1, np.int64).tobytes()
        for _ in range(rounds):
            status, msg = c.request(Op.ACCUMULATE, 10, 0, n * 8, DType.INT64, payload=payload)
            assert status == Status.OK, msg
        c.close()
    run_ranks(workers, work, timeout=60)
    total = rounds * sum(range(1, workers + 1))
    values = extent.array("<i8")
    assert values.min() == total and values.max() == total
    assert stats.snapshot()["bytes_accumulated"] == rounds * workers * n * 8


def _send_raw(port: int, data: bytes, close: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        if close:
            s.shutdown(socket.SHUT_WR)
    except OSError:  # the server may reset the connection before we are done
        pass
    return s


@pytest.mark.parametrize("garbage", [
    b"\x00" * wire.REQUEST.size,                                     # bad magic
    os.urandom(4000),                                                # random bytes
    wire.pack_request(Op.HELLO, 1, length=100)[:20],                 # truncated header
    wire.pack_request(Op.HELLO, 1, length=100) + b"x" * 10,          # truncated payload
    wire.pack_request(Op.READ, 1, 1, 0, 8),                          # no HELLO
    wire.pack_request(99, 1),                                        # unknown opcode
    wire.pack_request(Op.HELLO, 1, length=wire.MAX_TICKET + 1),      # oversized ticket
])
def test_protocol_violations_close_only_that_connection(planes, garbage):
    _arena, tcp, _shm, stats = planes
    good = Raw(tcp.port, ticket([1]))
    bad = _send_raw(tcp.port, garbage)
    bad.settimeout(5)
    try:
        assert bad.recv(100) == b""   # the server closed it without answering
    except ConnectionResetError:      # ... with unread bytes: a reset
        pass
    bad.close()
    assert good.request(Op.READ, 1, 0, 4) == (Status.OK, bytes(4))
    fresh = Raw(tcp.port, ticket([1]))
    assert fresh.request(Op.PING)[0] == Status.OK
    good.close()
    fresh.close()


def test_oversized_length_closes_an_authenticated_connection(planes):
    _arena, tcp, _shm, _stats = planes
    c = Raw(tcp.port, ticket([1]))
    wire.sendmsg_all(c.sock, [wire.pack_request(Op.WRITE, 9, 1, 0, wire.MAX_PAYLOAD + 1)])
    assert c.closed_by_server()


# -- shm ------------------------------------------------------------------------------

def fetch_fd(path: str, token: str, extent_id: int, sock: socket.socket | None = None):
    """(status, message, length, fd) from the shm plane."""
    own = sock is None
    if own:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(path)
    raw = token.encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw + struct.pack("<Q", extent_id))
    data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
    status, n = struct.unpack_from("<BI", data)
    need = 5 + n + (8 if status == 0 else 0)
    while len(data) < need:
        data += sock.recv(need - len(data))
    length = struct.unpack_from("<Q", data, 5 + n)[0] if status == 0 else 0
    if own:
        sock.close()
    return status, data[5:5 + n].decode(), length, (fds[0] if fds else None)


def test_shm_passes_descriptors(planes):
    arena, tcp, shm, _stats = planes
    assert shm.endpoint == f"shm://{shm.path}"
    status, _msg, length, fd = fetch_fd(shm.path, ticket([1]), 1)
    assert status == Status.OK and length == MiB
    m = mmap.mmap(fd, HEADER_BYTES + length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    m[HEADER_BYTES:HEADER_BYTES + 5] = b"via-m"
    c = Raw(tcp.port, ticket([1]))
    assert c.request(Op.READ, 1, 0, 5) == (Status.OK, b"via-m")
    assert struct.unpack_from("<Q", m, LIVE_OFFSET)[0] == 1
    arena.release(1)
    assert struct.unpack_from("<Q", m, LIVE_OFFSET)[0] == 0
    assert m[HEADER_BYTES:HEADER_BYTES + 5] == bytes(5)
    m.close()
    c.close()


def test_shm_read_only_descriptor_cannot_be_mapped_writable(planes):
    arena, _tcp, shm, _stats = planes
    arena.get(2).data[:3] = b"abc"
    status, _msg, length, fd = fetch_fd(shm.path, ticket([2], mode="ro"), 2)
    assert status == Status.OK
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, HEADER_BYTES + length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        m = mmap.mmap(fd, HEADER_BYTES + length, mmap.MAP_SHARED, mmap.PROT_READ)
        assert m[HEADER_BYTES:HEADER_BYTES + 3] == b"abc"
        m.close()
    finally:
        os.close(fd)


def test_shm_refusals_keep_the_connection(planes):
    arena, _tcp, shm, _stats = planes
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(shm.path)
    assert fetch_fd(shm.path, ticket([1], secret=b"y" * 32), 1, sock)[:1] == (Status.INVALID_TICKET,)
    assert fetch_fd(shm.path, ticket([1]), 2, sock)[0] == Status.INVALID_TICKET
    assert fetch_fd(shm.path, ticket([3]), 3, sock)[0] == Status.EXTENT_NOT_FOUND   # other region
    arena.release(2)
    status, msg, _len, fd = fetch_fd(shm.path, ticket([2]), 2, sock)
    assert status == Status.EXTENT_NOT_FOUND and fd is None and "extent 2" in msg
    status, _msg, _len, fd = fetch_fd(shm.path, ticket([1]), 1, sock)
    assert status == Status.OK and fd is not None
    os.close(fd)
    # malformed: an absurd ticket length closes that connection only
    sock.sendall(struct.pack("<I", wire.MAX_TICKET + 1))
    try:
        assert sock.recv(10) == b""
    except ConnectionResetError:
        pass
    sock.close()
    assert fetch_fd(shm.path, ticket([1]), 1)[0] == Status.OK


# -- a whole server against a fake controller ------------------------------------------

class FakeController(controller_pb2_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.registrations: list = []
        self.heartbeats: list = []
        self.orphans: list[int] = []
        self.forget = False

    def RegisterServer(self, request, context):
        self.registrations.append(request)
        self.forget = False
        orphans, self.orphans = self.orphans, []
        return controller_pb2.RegisterServerResponse(server_id=request.server_id, lease_seconds=3.0,
                                                     orphan_extent_ids=orphans)

    def Heartbeat(self, request, context):
        self.heartbeats.append(request)
        if self.forget:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown server")
        orphans, self.orphans = self.orphans, []
        return controller_pb2.HeartbeatResponse(lease_seconds=3.0, orphan_extent_ids=orphans)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_memory_server_lifecycle(tmp_path):
    fake = FakeController()
    ctl = make_server(max_workers=4)
    controller_pb2_grpc.add_ControllerServicer_to_server(fake, ctl)
    ctl_port = ctl.add_insecure_port("127.0.0.1:0")
    ctl.start()
    state = tmp_path / "state"
    cfg = ServerConfig(controller=f"127.0.0.1:{ctl_port}", capacity=8 * MiB, token="tok",
                       secret=SECRET, state_dir=str(state), heartbeat_seconds=0.05,
                       ready_file=str(tmp_path / "ready"))
    try:
        with MemoryServer(cfg) as server:
            assert server.state == "running"
            assert server.wait_registered(10)
            ready = json.loads((tmp_path / "ready").read_text())
            assert ready["server_id"] == server.server_id == (state / "server_id").read_text().strip()
            assert [e.split(":")[0] for e in ready["endpoints"]] == ["tcp", "shm"]
            reg = fake.registrations[0]
            assert reg.capacity_bytes == 8 * MiB and reg.grpc_address == server.grpc_address

            stub = memory_server_pb2_grpc.MemoryServerStub(rpc.channel(server.grpc_address))
            admin = ticket([5], mode="admin")
            rpc.call(stub.ReserveExtent, memory_server_pb2.ReserveExtentRequest(
                ticket=admin, extent_id=5, region_uid=UID, length=MiB), None, 5)
            with pytest.raises(PermissionDenied):
                rpc.call(stub.ReserveExtent, memory_server_pb2.ReserveExtentRequest(
                    ticket=ticket([6], mode="rw"), extent_id=6, region_uid=UID, length=MiB), None, 5)
            with pytest.raises(InvalidTicket):
                rpc.call(stub.ReserveExtent, memory_server_pb2.ReserveExtentRequest(
                    ticket=admin, extent_id=6, region_uid=UID, length=MiB), None, 5)
            with pytest.raises(OutOfMemory):
                rpc.call(stub.ReserveExtent, memory_server_pb2.ReserveExtentRequest(
                    ticket=ticket([7], mode="admin"), extent_id=7, region_uid=UID, length=64 * MiB),
                    None, 5)
            with pytest.raises(InvalidArgument, match="rdma"):
                rpc.call(stub.Connect, memory_server_pb2.ConnectRequest(ticket=admin), None, 5)
            with pytest.raises(AuthenticationError):
                rpc.call(stub.Stats, memory_server_pb2.StatsRequest(), None, 5)

            port = int(ready["endpoints"][0].rsplit(":", 1)[1])
            c = Raw(port, ticket([5]))
            assert c.request(Op.WRITE, 5, 0, 4, payload=b"data")[0] == Status.OK
            c.close()
            stats = rpc.call(stub.Stats, memory_server_pb2.StatsRequest(), "tok", 5)
            assert (stats.server_id, stats.used_bytes, stats.extents) == (server.server_id, MiB, 1)
            assert stats.bytes_written == 4 and stats.rss_bytes > 0 and len(stats.endpoints) == 2
            _wait(lambda: any(h.extents and h.extents[0].extent_id == 5 for h in fake.heartbeats))

            fake.orphans = [5]                              # the controller disowns extent 5
            _wait(lambda: len(server.arena) == 0)
            fake.forget = True                              # the controller lost track of us
            _wait(lambda: len(fake.registrations) >= 2)
            released = rpc.call(stub.ReleaseExtent, memory_server_pb2.ReleaseExtentRequest(
                ticket=admin, extent_id=5), None, 5)
            assert released.released is False
            with pytest.raises(ExtentNotFound):
                server.arena.get(5)
            server_id = server.server_id
        assert server.state == "closed"
        with MemoryServer(cfg) as again:                    # a restart keeps its id
            assert again.server_id == server_id
    finally:
        ctl.stop(0)


def test_memory_server_serves_without_controller(tmp_path):
    cfg = ServerConfig(controller="127.0.0.1:1", capacity=MiB, secret=SECRET, heartbeat_seconds=0.05,
                       transports=["tcp"])
    with MemoryServer(cfg) as server:
        assert not server.wait_registered(0.3)
        assert server.shm is None and len(server.endpoints) == 1
        server.arena.reserve(1, UID, 4096)
        c = Raw(server.tcp.port, ticket([1]))
        assert c.request(Op.READ, 1, 0, 4) == (Status.OK, bytes(4))
        c.close()
