"""Replicated extents on the memory-server side: a primary forwards every mutation to its
backups, in order, exactly once (``smb_server/memserver/replication.py``).

Two to four memory servers run in-process, each an arena with its own tcp plane, dedup
table and gRPC service (real sockets); the test plays the controller (ConfigureReplicas
with admin tickets signed by the shared secret) and a plain client (the tcp session of
``smb_client``), so every byte crosses the same wire as in a cluster.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from smb_client.transports.tcp import TcpConnection
from smb_protocol import tickets, wire
from smb_protocol.dtypes import DType
from smb_protocol.errors import InvalidArgument, NotPrimary, ReadOnly, ServerUnavailable, Status
from smb_protocol.wire import Op
from smb_server.memserver import dedup, replication
from smb_server.memserver.arena import HEADER_BYTES
from smb_server.testing import run_ranks, wait_until
from tests.integration.memserver.planes import typed

from .nodes import SECRET, SIZE, UID, Client, MiB, Node


def replica_set(make, n: int = 2) -> list[Node]:
    """A primary and ``n - 1`` backups at view 1 (controller order: primary, then backups)."""
    primary, *backups = make(n)
    primary.configure(1, "primary", backups)
    for b in backups:
        b.configure(1, "backup")
    return [primary, *backups]


def accumulate_in_background(client: Client) -> tuple[threading.Event, list[object]]:
    """Start adding one to each of the first 1000 int64s through ``client`` on a thread of
    its own. The event is set when the request ended; the list then holds "ok", or the
    exception it raised."""
    done = threading.Event()
    result: list[object] = []

    def mutate() -> None:
        try:
            client.accumulate(0, np.ones(1000, np.int64))
            result.append("ok")
        except Exception as exc:   # reported to the test through result
            result.append(exc)
        done.set()
    threading.Thread(target=mutate).start()
    return done, result


def primary_conn(backup: Node, client_id: int = 0, view: int = 1) -> TcpConnection:
    """A connection that speaks to ``backup`` as a primary of ``view`` does (a replica
    ticket), with the pieces numbered for ``client_id``."""
    conn = TcpConnection("127.0.0.1", backup.tcp.port, client_id=client_id)
    conn.present(tickets.sign(SECRET, UID, [backup.eid], "replica", ttl=600, view=view)[0])
    return conn


def test_concurrent_accumulates_are_exact_and_identical_on_every_copy(nodes):
    primary, b1, b2 = replica_set(nodes, 3)
    words = SIZE // 8
    rounds = 3

    def worker(i: int) -> None:
        c = Client(primary)
        try:
            for _ in range(rounds):
                c.accumulate(0, np.full(words, i + 1, np.int64))            # 10 MiB: 3 pieces
                c.accumulate(8 * (i + 1), np.arange(100, dtype=np.int64))  # small, overlapping
        finally:
            c.close()
    run_ranks(4, worker)
    expect = np.full(words, rounds * (1 + 2 + 3 + 4), np.int64)
    for i in range(4):
        expect[i + 1:i + 101] += rounds * np.arange(100, dtype=np.int64)
    for node in (primary, b1, b2):
        assert np.array_equal(node.array(np.int64), expect), node.name
    assert primary.repl.counts["pieces"] > 0 and primary.repl.counts["failures"] == 0


def test_float_accumulates_leave_identical_bytes(nodes):
    primary, backup = replica_set(nodes)
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal(SIZE // 4).astype(np.float32) for _ in range(3)]

    def worker(i: int) -> None:
        c = Client(primary)
        try:
            for _ in range(2):
                c.accumulate(0, parts[i])
                c.session.scale(c.ticket, primary.eid, 0, 1 * MiB, DType.FLOAT32, 0.5, seq=next(c.seqs))
        finally:
            c.close()
    run_ranks(3, worker)
    assert primary.data() == backup.data()
    assert np.any(primary.array(np.float32) != 0)


def test_overlapping_writes_leave_copies_byte_identical(nodes):
    primary, backup = replica_set(nodes)

    def worker(i: int) -> None:
        c = Client(primary)
        try:
            for k in range(6):
                off = (i * 1_234_567 + k * 777_777) % (SIZE - 5 * MiB)
                c.write(off, bytes([i * 16 + k]) * (5 * MiB))
        finally:
            c.close()
    run_ranks(4, worker)
    assert primary.data() == backup.data() and any(backup.data())


def test_retry_at_promoted_backup_is_answered_as_done(nodes):
    primary, backup = replica_set(nodes)
    c = Client(primary)
    ones = np.ones(SIZE // 8, np.int64)
    seq = c.accumulate(0, ones)
    fa_seq = next(c.seqs)
    old = c.session.fetch_add(c.ticket, primary.eid, 0, 5, seq=fa_seq)
    assert old == 1
    # the primary dies; the controller promotes the backup (backups first, then the new primary)
    primary.tcp.close()
    backup.configure(2, "primary")
    c.close()
    c.session = c.open(backup)
    c.accumulate(0, ones, seq=seq)                       # the same numbered request: done already
    assert c.session.fetch_add(c.ticket, backup.eid, 0, 5, seq=fa_seq) == 1   # its first answer
    got = backup.array(np.int64)
    assert got[0] == 1 + 5 and np.all(got[1:] == 1)
    c.close()


def test_request_cut_mid_way_resumes_at_promoted_backup(nodes):
    """The primary forwarded the first piece of an accumulate, then died: the client's
    retry at the promoted backup applies only the rest."""
    primary, backup = replica_set(nodes)
    client_id, seq = 0x5EED, 77
    data = np.arange(SIZE // 8, dtype=np.int64)
    raw = memoryview(data).cast("B")
    piece = replication.SYNC_CHUNK
    conn = primary_conn(backup, client_id)
    conn.request(typed(Op.ACCUMULATE, backup.eid, 0, piece, DType.INT64, arg0=0, arg1=SIZE, seq=seq,
                       client=client_id), [raw[:piece]])
    conn.close()
    backup.configure(2, "primary")
    c = Client(backup, client_id)
    c.accumulate(0, data, seq=seq)
    assert np.array_equal(backup.array(np.int64), data)   # once, not the first piece twice
    c.close()


def test_sync_of_a_new_backup_while_writers_run(nodes):
    primary, newcomer = nodes(2, size=32 * MiB)
    primary.configure(1, "primary")
    stop = threading.Event()

    def writer(i: int) -> None:
        c = Client(primary)
        rng = np.random.default_rng(i)
        try:
            while not stop.is_set():
                off = int(rng.integers(0, 32 * MiB - MiB)) & ~7
                if i % 2:
                    c.write(off, rng.bytes(int(rng.integers(1, MiB))))
                else:
                    c.accumulate(off, np.ones(int(rng.integers(1, MiB // 8)), np.int64))
        finally:
            c.close()
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    answer = primary.configure(2, "primary", [newcomer], sync=[newcomer])
    newcomer.configure(2, "backup")
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(60)
    assert answer.view == 2 and answer.synced_bytes == 32 * MiB
    assert primary.data() == newcomer.data()
    assert primary.repl.counts["sync_bytes"] == 32 * MiB


def test_a_copy_filled_by_sync_knows_what_the_primary_applied(nodes):
    """Requests the primary finished before a new copy joined reached that copy through
    the sync's bytes, not as forwarded pieces; the sync also hands over the primary's
    exactly-once entries for the extent, so a retry that reaches the copy after it was
    promoted (the primary died, the answer was lost) is answered, not applied again."""
    primary, newcomer = nodes(2)
    primary.configure(1, "primary")
    c = Client(primary)
    ones = np.ones(SIZE // 8, np.int64)
    seq = c.accumulate(0, ones)                       # its answer is "lost"
    fa_seq = next(c.seqs)
    assert c.session.fetch_add(c.ticket, primary.eid, 8, 5, seq=fa_seq) == 1
    answer = primary.configure(2, "primary", [newcomer], sync=[newcomer])
    newcomer.configure(2, "backup")
    assert answer.synced_bytes == SIZE
    primary.tcp.close()                               # the primary dies; the copy is promoted
    newcomer.configure(3, "primary")
    c.close()
    c.session = c.open(newcomer)
    c.accumulate(0, ones, seq=seq)                    # the same numbered requests again
    assert c.session.fetch_add(c.ticket, newcomer.eid, 8, 5, seq=fa_seq) == 1   # the first answer
    got = newcomer.array(np.int64)
    assert got[1] == 1 + 5 and got[0] == 1 and np.all(got[2:] == 1), got[:4]
    c.close()


def test_a_copy_synced_again_forgets_what_an_earlier_primary_forwarded(nodes):
    """A backup of an old primary applied a request the new primary never saw (the old
    primary forwarded it, then was deposed, and the client's answer was lost). Synced
    from the new primary, the copy's bytes are the new primary's; when the client's retry
    is applied there and forwarded, the copy applies it too instead of taking it for a
    repeat of the old primary's piece (its copy and the primary's would differ by it)."""
    new_primary, copy = nodes(2)
    client_id, seq = 0x5EED, 41
    data = np.arange(SIZE // 8, dtype=np.int64)
    raw = memoryview(data).cast("B")
    copy.configure(1, "backup")
    conn = primary_conn(copy, client_id)              # the old primary's pieces, all of them
    for first in range(0, SIZE, replication.SYNC_CHUNK):
        n = min(replication.SYNC_CHUNK, SIZE - first)
        conn.request(typed(Op.ACCUMULATE, copy.eid, first, n, DType.INT64, arg0=0, arg1=SIZE, seq=seq,
                           client=client_id), [raw[first:first + n]])
    conn.close()
    # the new primary (a copy that never saw the request) brings the copy in step again
    new_primary.configure(2, "primary", [copy], sync=[copy])
    copy.configure(2, "backup")
    assert copy.data() == new_primary.data()
    c = Client(new_primary, client_id)
    c.accumulate(0, data, seq=seq)                    # the retry: fresh at the new primary
    assert np.array_equal(new_primary.array(np.int64), data)
    assert copy.data() == new_primary.data()
    c.close()


def test_a_piece_of_an_older_view_stops_when_its_copy_is_synced_again(nodes):
    """The old primary's piece was still streaming into the copy (a slow link) when a new
    primary began to copy its bytes there: the rest of the piece is refused, so it lands
    neither on the copied bytes nor in the copy's exactly-once table (the client's retry,
    applied at the new primary and forwarded, is then applied there once)."""
    new_primary, copy = nodes(2)
    client_id, seq = 0x5EED, 43
    data = np.arange(SIZE // 8, dtype=np.int64)
    raw = memoryview(data).cast("B")
    copy.configure(1, "backup")
    conn = primary_conn(copy, client_id)
    req_id, frames = conn.frames.request(typed(Op.ACCUMULATE, copy.eid, 0, SIZE, DType.INT64, arg0=0, arg1=SIZE,
                                               seq=seq, client=client_id), [raw])
    half = SIZE // 2
    wire.sendmsg_all(conn.sock, [frames[0], raw[:half]])        # the first half streams in
    wait_until(lambda: copy.array(np.int64)[1] != 0, what="the first chunk applied")
    new_primary.configure(2, "primary", [copy], sync=[copy])    # a new primary copies its bytes there
    copy.configure(2, "backup")
    wire.sendmsg_all(conn.sock, [raw[half:]])                   # the rest of the old piece
    answer = conn.frames.answer(wire.recv_exact(conn.sock, wire.RESPONSE.size))
    assert answer.req_id == req_id and not answer.ok
    conn.close()
    assert copy.data() == new_primary.data()
    c = Client(new_primary, client_id)
    c.accumulate(0, data, seq=seq)                              # the retry, fresh at the new primary
    assert np.array_equal(new_primary.array(np.int64), data)
    assert copy.data() == new_primary.data()
    c.close()


def test_a_forward_refused_for_a_newer_view_is_resumed_not_refused_again(nodes):
    """The controller configures a backup at a newer view before its primary (a sync
    driven again by a controller that restarted): a mutation the primary applies between
    the two calls is refused by the backup, and its client hears NotPrimary. The primary,
    configured at the new view, copies its bytes (that mutation's included) and its
    exactly-once entries to the copy; the client's retry, at the primary or at the copy
    once promoted, is answered as done: neither refused for ever nor applied twice."""
    primary, copy = replica_set(nodes)
    c = Client(primary)
    copy.configure(2, "backup")
    ones = np.ones(SIZE // 8, np.int64)
    seq, fa_seq = next(c.seqs), next(c.seqs)
    with pytest.raises(NotPrimary):
        c.accumulate(0, ones, seq=seq)                # applied here, refused by the copy
    with pytest.raises(NotPrimary):
        c.session.fetch_add(c.ticket, primary.eid, 8, 5, seq=fa_seq)
    primary.configure(2, "primary", [copy], sync=[copy])
    assert copy.data() == primary.data()
    c.accumulate(0, ones, seq=seq)                    # the retries, at the new view
    assert c.session.fetch_add(c.ticket, primary.eid, 8, 5, seq=fa_seq) == 1
    got = primary.array(np.int64)
    assert got[1] == 1 + 5 and got[0] == 1 and np.all(got[2:] == 1), got[:4]
    assert copy.data() == primary.data()
    primary.tcp.close()                               # and at the copy, once promoted
    copy.configure(3, "primary")
    c.close()
    c.session = c.open(copy)
    c.accumulate(0, ones, seq=seq)
    assert c.session.fetch_add(c.ticket, copy.eid, 8, 5, seq=fa_seq) == 1
    assert np.array_equal(copy.array(np.int64), got)
    c.close()


def test_exactly_once_entries_are_taken_from_a_primary_only(nodes):
    """A client cannot plant answers in a server's exactly-once table: SEED over a
    client's ticket is refused with a typed error, and the connection and server go on."""
    primary, backup = replica_set(nodes)
    c = Client(primary)
    (forged,) = dedup.pack_records([(c.id, 1, (int(Op.ACCUMULATE), primary.eid, 0, 8, 3), 8, True, 0, b"")])
    conn = TcpConnection("127.0.0.1", primary.tcp.port, client_id=c.id)
    conn.present(c.ticket)
    with pytest.raises(InvalidArgument, match="from a primary only"):
        conn.request(typed(Op.SEED, primary.eid, 0, len(forged)), [memoryview(forged)])
    assert conn.request(typed(Op.PING)) == b""                      # same connection, still served
    conn.close()
    c.accumulate(0, np.ones(1, np.int64), seq=1)              # the forged answer was not taken
    assert primary.array(np.int64)[0] == 1 and backup.array(np.int64)[0] == 1
    c.close()


def test_failed_backup_holds_acknowledgement_until_it_is_dropped(nodes):
    primary, backup = replica_set(nodes)
    backup.tcp.close()                                    # the backup dies
    c = Client(primary)
    done, result = accumulate_in_background(c)
    assert not done.wait(1.0), result                     # waits: not acknowledged
    assert primary.repl.counts["failures"] == 1
    primary.configure(2, "primary", [])                  # the controller drops the backup
    assert done.wait(10) and result == ["ok"]
    assert primary.array(np.int64)[999] == 1
    # with the failed backup still configured, a request ends in ServerUnavailable after the
    # replica timeout; its retry (same number) is answered once the backup is dropped
    primary.configure(3, "primary", [backup])
    primary.repl.timeout = 0.5
    seq = next(c.seqs)
    with pytest.raises(ServerUnavailable):
        c.accumulate(0, np.ones(1000, np.int64), seq=seq)
    primary.configure(4, "primary", [])
    c.accumulate(0, np.ones(1000, np.int64), seq=seq)
    assert primary.array(np.int64)[999] == 2            # applied once
    c.close()


def test_a_failed_backup_is_reported_at_once_until_it_is_dropped(nodes):
    """What the heartbeat carries: the primary asks for one at once when a backup is
    newly marked failed, and lists it (with its view) until a new view drops it."""
    primary, backup = replica_set(nodes)
    asked: list[float] = []
    primary.repl.on_failure = lambda: asked.append(time.monotonic())
    assert primary.repl.failed_backups() == []
    backup.tcp.close()                                    # the backup's data plane goes
    c = Client(primary)
    done, result = accumulate_in_background(c)
    deadline = time.monotonic() + 10
    while not asked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(asked) == 1 and not done.is_set()
    (failed,) = primary.repl.failed_backups()
    assert (failed.primary_extent_id, failed.backup_extent_id, failed.view) == (primary.eid, backup.eid, 1)
    assert failed.reason
    primary.configure(2, "primary", [])                  # what the controller does with it
    assert done.wait(10) and result == ["ok"]
    assert primary.repl.failed_backups() == [] and len(asked) == 1
    c.close()


def test_view_changes_of_a_staying_primary_lose_no_piece(nodes):
    """The controller configures a primary that stays at a new view, then its backups:
    a piece forwarded under the old view must not reach a backup already at the new one
    (it would refuse it as a deposed primary's, and the copies would differ)."""
    primary, backup = replica_set(nodes)
    c = Client(primary)
    stop = threading.Event()
    rounds: list[int] = []
    failures: list[BaseException] = []

    def accumulate() -> None:
        try:
            while not stop.is_set():
                c.accumulate(0, np.ones(SIZE // 8, np.int64))
                rounds.append(1)
        except BaseException as exc:   # reported below
            failures.append(exc)
    t = threading.Thread(target=accumulate)
    t.start()
    try:
        for view in range(2, 60):
            primary.configure(view, "primary", [backup])
            backup.configure(view, "backup")
            if failures:
                break
    finally:
        stop.set()
        t.join(60)
        c.close()
    assert not failures, failures
    assert rounds and primary.data() == backup.data()
    np.testing.assert_array_equal(primary.array(np.int64), len(rounds))


def test_backups_refuse_clients_and_deposed_primaries(nodes):
    primary, backup = replica_set(nodes)
    Client(primary).write(0, b"hello")
    c = Client(backup)
    with pytest.raises(NotPrimary):
        c.write(0, b"bypass")
    with pytest.raises(NotPrimary):
        c.session.fetch_add(c.ticket, backup.eid, 8, 1, seq=next(c.seqs))
    assert c.read(0, 5) == b"hello"                       # reads work on a backup
    backup.configure(2, "primary")                        # promoted: the old primary is deposed
    with pytest.raises(NotPrimary):
        Client(primary).write(0, b"stale")                # its forward (view 1) is refused
    assert backup.data()[:5] == b"hello"
    conn = primary_conn(backup)
    with pytest.raises(NotPrimary):
        conn.request(typed(Op.WRITE, backup.eid, 0, 5, arg0=0, arg1=5), [memoryview(b"stale")])
    conn.close()
    c.close()


def test_views_only_grow_and_repeat_is_idempotent(nodes):
    primary, backup = replica_set(nodes)
    assert primary.configure(1, "primary", [backup]).view == 1
    primary.configure(3, "primary", [backup])
    with pytest.raises(InvalidArgument):
        primary.configure(2, "primary", [backup])
    with pytest.raises(InvalidArgument):
        primary.configure(4, "mirror")


def test_atomics_and_locks_are_forwarded(nodes):
    primary, backup = replica_set(nodes)
    c = Client(primary)
    assert c.session.fetch_add(c.ticket, primary.eid, 64, 7, seq=next(c.seqs)) == 0
    assert c.session.compare_swap(c.ticket, primary.eid, 64, 7, 9, seq=next(c.seqs)) == 7
    conn = TcpConnection("127.0.0.1", primary.tcp.port, client_id=c.id)
    conn.present(c.ticket)
    assert conn.request(typed(Op.LOCK, primary.eid, 128, 8, arg0=42, arg1=5000, alpha=1.0, seq=1001,
                              client=c.id)) == bytes(8)
    assert primary.data()[64:136] == backup.data()[64:136]
    assert struct.unpack_from("<q", backup.data(), 128)[0] == 42
    assert conn.request(typed(Op.UNLOCK, primary.eid, 128, 8, arg0=42, seq=1002, client=c.id)) == \
        struct.pack("<q", 42)
    assert struct.unpack_from("<q", backup.data(), 128)[0] == 0
    with pytest.raises(NotPrimary):   # collectives use unreplicated regions (and wait out a move)
        conn.request(typed(Op.PUSH, primary.eid, 0, 8, DType.INT64, arg0=1024 | 1 << 48, arg1=0, alpha=1.0,
                           seq=1003, client=c.id), [memoryview(bytes(8))])
    conn.close()
    c.close()


def test_shm_hands_out_read_only_descriptors_of_replicated_extents(nodes):
    primary, backup = replica_set(nodes)
    for node in (primary, backup):
        rw = tickets.sign(SECRET, UID, [node.eid], "rw", ttl=600)[0]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(node.shm.path)
            raw = rw.encode()
            sock.sendall(struct.pack("<I", len(raw)) + raw + struct.pack("<Q", node.eid))
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        assert data[0] == Status.OK and fds
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], HEADER_BYTES + SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            m = mmap.mmap(fds[0], HEADER_BYTES + SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            assert struct.unpack_from("<Q", m, 8)[0] == 2   # the live word: held, mutations through the server
            m.close()
        finally:
            os.close(fds[0])



def test_a_read_write_ticket_writes_directly_again_once_its_extent_stops_being_replicated(nodes):
    """A client mapped the extent while it was replicated (a move's copy, read-only to
    it); once the controller made it an unreplicated extent again, the same ticket's
    writes go into the mapping, not refused as read-only."""
    from smb_client.transports.shm import ShmSession
    from smb_client.transports.tcp import TcpSession
    from smb_protocol.addressing import parse_endpoint

    (node,) = nodes(1)
    node.configure(1, "primary")          # the source of a move: its copy is listed elsewhere
    rw = tickets.sign(SECRET, UID, [node.eid], "rw", ttl=600)[0]
    tcp = TcpSession(parse_endpoint(node.endpoint), {"client_id": 7, "connections": 1})
    shm = ShmSession(parse_endpoint(f"shm://{node.shm.path}"), {"arithmetic": tcp})
    try:
        shm.write(rw, node.eid, 0, [memoryview(b"a" * 64)], seq=1)    # through the server
        assert not shm._maps[node.eid].writable
        node.configure(2, "")             # the move ended: it takes direct writes again
        shm.write(rw, node.eid, 64, [memoryview(b"b" * 64)], seq=2)
        assert shm._maps[node.eid].writable, "the ticket was not granted writing again"
        assert node.data()[:128] == b"a" * 64 + b"b" * 64
        ro = tickets.sign(SECRET, UID, [node.eid], "ro", ttl=600)[0]
        reader = TcpSession(parse_endpoint(node.endpoint), {"client_id": 8, "connections": 1})
        try:
            with pytest.raises(ReadOnly):     # the server still refuses a read-only ticket
                reader.write(ro, node.eid, 0, [memoryview(b"c" * 8)], seq=3)
        finally:
            reader.close()
        assert node.data()[:8] == b"a" * 8
    finally:
        shm.close()
        tcp.close()
