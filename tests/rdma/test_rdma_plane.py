"""The rdma transport against a real memory server (in this process, no controller):
tickets signed here, sessions driven directly, memory checked in the arena."""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time

import numpy as np
import pytest

from smb_client.transports.rdma import Broken, RdmaSession
from smb_protocol import errors, tickets
from smb_protocol.addressing import parse_endpoint
from smb_protocol.dtypes import DType, bf16_to_f32, f32_to_bf16
from smb_protocol.rdma_wire import MsgOp
from smb_server.memserver.main import MemoryServer
from smb_server.runtime.config import ServerConfig

pytestmark = pytest.mark.rdma

SECRET = b"r" * 32
UID = "region-a"
MiB = 1 << 20


def ticket(extent_ids, mode="rw", uid=UID, secret=SECRET, ttl=600.0) -> str:
    return tickets.sign(secret, uid, extent_ids, mode, ttl=ttl)[0]


@pytest.fixture(scope="module")
def server():
    cfg = ServerConfig(controller="127.0.0.1:1", capacity=256 * MiB, secret=SECRET,
                       transports=["tcp", "rdma"], heartbeat_seconds=30)
    with MemoryServer(cfg) as s:
        assert s.rdma is not None, "the rdma plane did not start"
        yield s


@pytest.fixture
def uri(server):
    (rdma,) = [e for e in server.endpoints if e.startswith("rdma://")]
    return rdma


_ids = iter(range(100, 1 << 30))


@pytest.fixture
def extent(server):
    """A fresh 8 MiB extent of region UID; released afterwards."""
    eid = next(_ids)
    server.arena.reserve(eid, UID, 8 * MiB)
    yield eid
    server.arena.release(eid)


def session(uri, extent_ids, mode="rw", **options) -> tuple[RdmaSession, str]:
    """A session of its own and a ticket for ``extent_ids``."""
    return RdmaSession(parse_endpoint(uri), options), ticket(extent_ids, mode)


def test_endpoint_and_registration(server, uri, extent):
    assert uri == f"rdma://{server.grpc_address}"
    reg = server.rdma._regs[extent]
    assert reg.rw.rkey != reg.ro.rkey and reg.address == server.arena.get(extent).address


def test_write_read_roundtrip(server, uri, extent):
    s, tok = session(uri, [extent])
    data = np.random.default_rng(1).integers(0, 256, 5 * MiB + 7, dtype=np.uint8)
    s.write(tok, extent, 123, [memoryview(data)])
    assert bytes(server.arena.get(extent).data[123:123 + len(data)]) == data.tobytes()
    out = np.empty_like(data)
    s.read_into(tok, extent, 123, [memoryview(out)])
    assert np.array_equal(out, data)
    # scatter/gather, small bytes (bounced), a large bytearray (registered for one op)
    small, big = b"hello rdma", bytearray(os.urandom(3 * MiB))
    s.write(tok, extent, 0, [memoryview(small), memoryview(big)])
    a, b = bytearray(len(small)), bytearray(len(big))
    s.read_into(tok, extent, 0, [memoryview(a), memoryview(b)])
    assert a == small and b == big
    # an array, zero copy, twice (the second hits the registration cache)
    t = np.arange(MiB // 4, dtype=np.float32)
    for _ in range(2):
        s.write(tok, extent, 4 * MiB, [memoryview(t).cast("B")])
    back = np.empty_like(t)
    s.read_into(tok, extent, 4 * MiB, [memoryview(back).cast("B")])
    assert np.array_equal(back, t)
    assert s.shared.cache.hits >= 1
    with pytest.raises(errors.OutOfRange):
        s.read_into(tok, extent, 8 * MiB - 4, [memoryview(bytearray(8))])
    s.close()


def test_transfers_larger_than_the_device_message(server, uri):
    eid = next(_ids)
    server.arena.reserve(eid, UID, 20 * MiB)
    s, tok = session(uri, [eid])
    data = np.random.default_rng(2).integers(0, 256, 20 * MiB, dtype=np.uint8)
    s.write(tok, eid, 0, [memoryview(data)])
    out = np.zeros_like(data)
    s.read_into(tok, eid, 0, [memoryview(out)])
    assert np.array_equal(out, data)
    s.close()
    server.arena.release(eid)


def test_small_work_requests_are_pipelined(server, uri, extent):
    """max_message splits one transfer into many work requests (more than the window)."""
    s, tok = session(uri, [extent], max_message=4096)
    data = np.random.default_rng(5).integers(0, 256, 3 * MiB + 100, dtype=np.uint8)   # 769 WRs
    s.write(tok, extent, 8, [memoryview(data)])
    assert bytes(server.arena.get(extent).data[8:8 + len(data)]) == data.tobytes()
    out = np.zeros_like(data)
    s.read_into(tok, extent, 8, [memoryview(out)])
    assert np.array_equal(out, data)
    s.close()
    with pytest.raises(errors.InvalidArgument, match="max_message"):
        session(uri, [extent], max_message=-1)


def test_atomics(server, uri, extent):
    s, tok = session(uri, [extent])
    assert s.fetch_add(tok, extent, 64, 5) == 0
    assert s.fetch_add(tok, extent, 64, -7) == 5
    assert np.frombuffer(server.arena.get(extent).data[64:72], "<i8")[0] == -2
    assert s.compare_swap(tok, extent, 64, -2, 42) == -2
    assert s.compare_swap(tok, extent, 64, 0, 7) == 42        # no swap
    assert np.frombuffer(server.arena.get(extent).data[64:72], "<i8")[0] == 42
    with pytest.raises(errors.Misaligned):
        s.fetch_add(tok, extent, 4, 1)
    s.close()


def test_pipelined_atomics(server, uri, extent):
    """More fetch-adds than the QP keeps in flight, on a few words, in one batch."""
    s, tok = session(uri, [extent], connections=1)
    items = [(8 * (k % 3), 1) for k in range(1000)]
    olds = s.fetch_add_many(tok, extent, items)
    for word in range(3):
        mine = [o for (off, _), o in zip(items, olds, strict=True) if off == 8 * word]
        assert mine == list(range(len(items[word::3])))
    assert list(np.frombuffer(server.arena.get(extent).data[:24], "<i8")) == [334, 333, 333]
    assert s.compare_swap(tok, extent, 0, 334, -1) == 334    # single atomics still work after a batch
    with pytest.raises(errors.Misaligned):
        s.fetch_add_many(tok, extent, [(0, 1), (3, 1)])
    assert s.fetch_add(tok, extent, 0, 0) == -1
    s.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32", "int64"])
def test_accumulate_every_dtype(server, uri, extent, dtype):
    s, tok = session(uri, [extent])
    rng = np.random.default_rng(3)
    n = (5 * MiB) // 8          # 2.5 to 5 MiB: more than one staging chunk
    if dtype == "bfloat16":
        a = f32_to_bf16(rng.standard_normal(n).astype(np.float32))
        b = f32_to_bf16(rng.standard_normal(n).astype(np.float32))
        expect = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))
    elif dtype.startswith("int"):
        a = rng.integers(-1000, 1000, n).astype(dtype)
        b = rng.integers(-1000, 1000, n).astype(dtype)
        expect = a + b
    else:
        a = rng.standard_normal(n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
        expect = a + b
    s.write(tok, extent, 0, [memoryview(a).cast("B")])
    s.accumulate(tok, extent, 0, [memoryview(b).cast("B")], DType[dtype.upper()])
    got = np.frombuffer(server.arena.get(extent).data[:a.nbytes], a.dtype)
    np.testing.assert_array_equal(got, expect)
    s.close()


def test_scale_and_axpy(server, uri, extent):
    s, tok = session(uri, [extent])
    n = 300_000
    a = np.linspace(-5, 5, n, dtype=np.float32)
    x = np.linspace(1, 2, n, dtype=np.float32)
    s.write(tok, extent, 0, [memoryview(a).cast("B")])
    s.scale(tok, extent, 0, a.nbytes, DType.FLOAT32, 0.5)
    s.accumulate(tok, extent, 0, [memoryview(x).cast("B")], DType.FLOAT32, alpha=-2.0)
    got = np.frombuffer(server.arena.get(extent).data[:a.nbytes], np.float32)
    np.testing.assert_allclose(got, a * np.float32(0.5) + np.float32(-2.0) * x, rtol=1e-6)
    with pytest.raises(errors.DtypeError):
        s.scale(tok, extent, 0, 8, DType.INT64, 2.0)            # a server-side error: a typed reply
    s.fetch_add(tok, extent, 0, 0)                               # ... and the QP is fine
    s.close()


def test_read_only_rkeys_refuse_writes(server, uri, extent):
    server.arena.get(extent).data[:4] = b"keep"
    s, tok = session(uri, [extent], mode="ro")
    with pytest.raises(errors.ReadOnly, match="read-only"):
        s.write(tok, extent, 0, [memoryview(b"nope")])
    assert bytes(server.arena.get(extent).data[:4]) == b"keep"
    buf = bytearray(4)
    s.read_into(tok, extent, 0, [memoryview(buf)])            # a fresh QP after the error
    assert buf == b"keep"
    with pytest.raises(errors.ReadOnly):
        s.fetch_add(tok, extent, 0, 1)
    with pytest.raises(errors.ReadOnly):
        s.accumulate(tok, extent, 0, [memoryview(bytes(8))], DType.FLOAT32)
    s.read_into(tok, extent, 0, [memoryview(buf)])
    assert buf == b"keep"
    s.close()


def test_connect_checks_the_ticket(server, uri, extent):
    s = RdmaSession(parse_endpoint(uri), {"connections": 1})
    with pytest.raises(errors.InvalidTicket):
        s.read_into(ticket([extent], secret=b"x" * 32), extent, 0, [memoryview(bytearray(8))])
    with pytest.raises(errors.TicketExpired):
        s.read_into(ticket([extent], ttl=-1), extent, 0, [memoryview(bytearray(8))])
    with pytest.raises(errors.ExtentNotFound):              # the extent is another region's
        s.read_into(ticket([extent], uid="region-b"), extent, 0, [memoryview(bytearray(8))])
    with pytest.raises(errors.PermissionDenied):
        s.read_into(ticket([extent], mode="admin"), extent, 0, [memoryview(bytearray(8))])
    s.read_into(ticket([extent]), extent, 0, [memoryview(bytearray(8))])   # the same QP, a good ticket
    s.close()


def test_deleted_extents_rkeys_stop_working(server, uri):
    old_id, new_id = next(_ids), next(_ids)
    server.arena.reserve(old_id, UID, MiB)
    s, tok = session(uri, [old_id])
    s.write(tok, old_id, 0, [memoryview(b"old data")])
    conn = s.pool.acquire()
    stale = conn.keys(tok).extents[old_id]
    s.pool.release(conn)
    server.arena.release(old_id)
    with pytest.raises(errors.ExtentNotFound):
        s.read_into(tok, old_id, 0, [memoryview(bytearray(8))])
    with pytest.raises(errors.ExtentNotFound):
        s.write(tok, old_id, 0, [memoryview(b"new data")])
    # someone else's new extent; the stale key, used through a valid connection, fails
    server.arena.reserve(new_id, "region-b", MiB)
    server.arena.get(new_id).data[:6] = b"secret"
    other = RdmaSession(parse_endpoint(uri), {})
    conn = other.pool.acquire()
    conn.keys(ticket([new_id], uid="region-b"))
    import pyverbs.enums as e
    out = bytearray(MiB)
    addr = memoryview_address(out)
    mr = other.shared.device.create_mr(addr, len(out), e.IBV_ACCESS_LOCAL_WRITE)
    with pytest.raises(Broken) as info:
        conn.post_rdma([(addr, mr.lkey, 4096, stale.address, stale.rkey)], read=True)
    conn.broken = True
    other.pool.release(conn)
    mr.close()
    assert isinstance(info.value.error, errors.ExtentNotFound)
    assert b"secret" not in out
    other.close()
    s.close()
    server.arena.release(new_id)


def test_one_queue_pair_carries_several_tickets(server, uri, extent):
    """Tickets of two regions (rw and ro) on one QP: each reaches only its extents with
    its rights, one-sided and two-sided; the server checks each request by the ticket
    presented for its extent."""
    other_id = next(_ids)
    server.arena.reserve(other_id, "region-b", MiB)
    server.arena.get(other_id).data[:8] = b"region b"
    before = server.rdma.connections
    s = RdmaSession(parse_endpoint(uri), {"connections": 1})
    tok_a, tok_b = ticket([extent]), ticket([other_id], mode="ro", uid="region-b")
    s.write(tok_a, extent, 0, [memoryview(np.ones(4, np.float32)).cast("B")])
    buf = bytearray(8)
    s.read_into(tok_b, other_id, 0, [memoryview(buf)])
    assert buf == b"region b"
    assert server.rdma.connections == before + 1              # both tickets on one queue pair
    (conn,) = [c for c in server.rdma._conns if extent in c.extent_ids]
    assert conn.extent_ids == {extent, other_id}
    with pytest.raises(errors.ExtentNotFound):                # ticket A does not name B's extent
        s.read_into(tok_a, other_id, 0, [memoryview(buf)])
    with pytest.raises(errors.ReadOnly):
        s.accumulate(tok_b, other_id, 0, [memoryview(bytes(8))], DType.FLOAT32)
    s.accumulate(tok_a, extent, 0, [memoryview(np.ones(4, np.float32)).cast("B")], DType.FLOAT32)
    assert list(np.frombuffer(server.arena.get(extent).data[:16], np.float32)) == [2.0] * 4
    # two-sided requests the client would not send: the server refuses them itself
    qp = s.pool.acquire()
    with pytest.raises(errors.ReadOnly):                      # B's ticket is read-only
        qp.take_reply(qp.send_request(MsgOp.SCALE, other_id, 0, 8, int(DType.FLOAT32), 0, 2.0), "scale")
    unnamed = next(_ids)
    server.arena.reserve(unnamed, UID, MiB)
    with pytest.raises(errors.InvalidTicket):                 # no ticket here names this extent
        qp.take_reply(qp.send_request(MsgOp.SCALE, unnamed, 0, 8, int(DType.FLOAT32), 0, 2.0), "scale")
    s.pool.release(qp)
    with pytest.raises(errors.ReadOnly):                      # B's rkeys have no write rights
        s.write(tok_b, other_id, 0, [memoryview(b"nope")])
    assert bytes(server.arena.get(other_id).data[:8]) == b"region b"
    s.read_into(tok_a, extent, 0, [memoryview(buf)])          # a fresh QP after the error
    s.close()
    server.arena.release(other_id)
    server.arena.release(unnamed)


@pytest.mark.timeout(120)
def test_renewed_ticket_keeps_the_queue_pair(server, uri, extent):
    """A renewed ticket (a new token) presented before the old one expires keeps the
    connection; a ticket left to expire ends it, with TicketExpired."""
    ttl = 15.0
    s = RdmaSession(parse_endpoint(uri), {"connections": 1})
    old, expires = tickets.sign(SECRET, UID, [extent], "rw", ttl=ttl)
    s.write(old, extent, 0, [memoryview(b"renew")])
    new = ticket([extent])
    s.fetch_add(new, extent, 8, 1)
    (conn,) = [c for c in server.rdma._conns if extent in c.extent_ids]
    time.sleep(max(0.0, expires - time.time()) + 2.5)          # the reaper runs every second
    assert conn in server.rdma._conns and not conn.doomed
    buf = bytearray(5)
    s.read_into(new, extent, 0, [memoryview(buf)])
    assert buf == b"renew"
    s.close()
    with pytest.raises(errors.TicketExpired):                 # presented on a new QP: refused
        RdmaSession(parse_endpoint(uri), {}).read_into(old, extent, 0, [memoryview(buf)])
    lone = RdmaSession(parse_endpoint(uri), {"connections": 1})
    short, expires = tickets.sign(SECRET, UID, [extent], "rw", ttl=ttl)
    lone.fetch_add(short, extent, 8, 1)
    (conn,) = [c for c in server.rdma._conns if extent in c.extent_ids]
    time.sleep(max(0.0, expires - time.time()) + 2.5)
    assert conn.doomed == "ticket expired" or conn not in server.rdma._conns
    with pytest.raises(errors.TicketExpired):
        lone.fetch_add(short, extent, 8, 1)
    lone.close()


def memoryview_address(buf) -> int:
    return int(np.frombuffer(buf, np.uint8, count=1).ctypes.data)


def test_error_completion_recovers_the_queue_pair(server, uri, extent):
    s, tok = session(uri, [extent], connections=1)
    s.write(tok, extent, 0, [memoryview(b"before")])
    for conn in list(server.rdma._conns):                  # the server drops every QP
        conn.doom("test", errors.ServerUnavailable("dropped by the test"))
    buf = bytearray(6)
    s.read_into(tok, extent, 0, [memoryview(buf)])             # notice -> reconnect -> ok
    assert buf == b"before"
    s.write(tok, extent, 0, [memoryview(b"after!")])
    assert bytes(server.arena.get(extent).data[:6]) == b"after!"
    s.close()


@pytest.mark.timeout(500)
def test_atomics_from_four_processes(server, uri, extent):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    n = 100
    from tests.rdma._atomic_worker import adder
    procs = [ctx.Process(target=adder, args=(uri, ticket([extent]), extent, n, q)) for _ in range(4)]
    for p in procs:
        p.start()
    olds = []
    for _ in procs:
        kind, value = q.get(timeout=400)    # the guest CPU is emulated: imports are slow
        assert kind == "ok", f"a worker failed:\n{value}"
        olds += value
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert np.frombuffer(server.arena.get(extent).data[8:16], "<i8")[0] == 4 * n
    assert sorted(olds) == list(range(4 * n))              # every old value seen exactly once


def _progress_sleeps(plane) -> bool:
    """Whether the plane's progress thread is blocked waiting for a connection."""
    frame = sys._current_frames().get(plane._thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def test_an_idle_plane_sleeps_until_a_connection_arrives():
    """With no connection the progress thread blocks instead of polling every few ms
    (an idle server costs no CPU); a connection wakes it, and its requests are served."""
    cfg = ServerConfig(controller="127.0.0.1:1", capacity=64 * MiB, secret=SECRET,
                       transports=["rdma"], heartbeat_seconds=30)
    with MemoryServer(cfg) as idle:
        plane = idle.rdma
        assert plane is not None
        deadline = time.monotonic() + 30
        while not _progress_sleeps(plane):
            assert time.monotonic() < deadline, "the progress thread of a plane without connections never slept"
            time.sleep(0.05)
        idle.arena.reserve(7, UID, MiB)
        s, tok = session([e for e in idle.endpoints if e.startswith("rdma://")][0], [7])
        ones = np.ones(4, np.float32)
        s.write(tok, 7, 0, [memoryview(ones).cast("B")])
        s.accumulate(tok, 7, 0, [memoryview(ones).cast("B")], DType.FLOAT32)   # served by the thread
        back = np.empty(4, np.float32)
        s.read_into(tok, 7, 0, [memoryview(back).cast("B")])
        assert back.tolist() == [2.0] * 4 and plane.connections == 1
        s.close()


def test_server_closes_connections_on_bye(server, uri, extent):
    before = server.rdma.connections
    s, tok = session(uri, [extent], connections=2)
    s.write(tok, extent, 0, [memoryview(b"x")])
    assert server.rdma.connections == before + 1
    s.close()
    deadline = time.monotonic() + 5
    while server.rdma.connections > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.rdma.connections == before


def test_numbered_arithmetic_is_applied_once(server, uri, extent):
    """A numbered accumulate (several staging messages) or scale sent again, on the same
    queue pair or on another session's, is answered and not applied twice; unnumbered
    ones apply each time."""
    a, tok = session(uri, [extent], client_id=0xABC)
    b, _ = session(uri, [extent], client_id=0xABC)      # the same client on another queue pair
    ones = np.ones(3 * MiB // 8, np.int64)              # more than one staging slot
    for s in (a, b, a):
        s.accumulate(tok, extent, 0, [memoryview(ones).cast("B")], DType.INT64, seq=5 << 20)
    x = np.full(1024, 2.0, np.float64)
    server.arena.get(extent).data[4 * MiB:4 * MiB + x.nbytes] = x.tobytes()
    for s in (a, b):
        s.scale(tok, extent, 4 * MiB, x.nbytes, DType.FLOAT64, 3.0, seq=6 << 20)
    a.accumulate(tok, extent, 0, [memoryview(ones).cast("B")], DType.INT64)   # seq 0: applies
    data = server.arena.get(extent).data
    assert np.array_equal(np.frombuffer(bytes(data[:ones.nbytes]), np.int64), ones * 2)
    assert np.array_equal(np.frombuffer(bytes(data[4 * MiB:4 * MiB + x.nbytes]), np.float64), x * 3)
    with pytest.raises(errors.InvalidArgument, match="names one request"):
        b.scale(tok, extent, 0, 64, DType.FLOAT64, 3.0, seq=6 << 20)           # another request, same number
    a.close()
    b.close()
