"""ConnectionPool: on-demand growth up to size, blocking hand-off between threads,
broken connections dropped and refilled, close. Connections are real socket pairs."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from smb_client.transports.pool import ConnectionPool
from smb_protocol.errors import InvalidArgument, ServerUnavailable, Timeout


class PairConnection:
    """A real socket pair; ``closed`` once our end is closed."""

    def __init__(self) -> None:
        self.sock, self.peer = socket.socketpair()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def echo(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        got = self.peer.recv(len(data))
        return got

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


class Factory:
    def __init__(self) -> None:
        self.made: list[PairConnection] = []
        self.lock = threading.Lock()

    def __call__(self) -> PairConnection:
        conn = PairConnection()
        with self.lock:
            self.made.append(conn)
        return conn


def test_connections_are_made_on_demand_and_reused():
    factory = Factory()
    with ConnectionPool(factory, size=3, name="tcp://x") as pool:
        assert pool.open_connections == 0
        with pool.borrow() as conn:
            assert conn.echo(b"hi") == b"hi"
        with pool.borrow() as again:
            assert again is conn
        assert len(factory.made) == 1
    assert conn.closed


def test_at_most_size_connections_under_contention():
    factory = Factory()
    pool = ConnectionPool(factory, size=2)
    in_use = 0
    peak = 0
    lock = threading.Lock()

    def work():
        nonlocal in_use, peak
        for _ in range(20):
            with pool.borrow() as conn:
                with lock:
                    in_use += 1
                    peak = max(peak, in_use)
                assert conn.echo(b"x") == b"x"
                time.sleep(0.001)
                with lock:
                    in_use -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak == 2
    assert len(factory.made) == 2
    pool.close()


def test_waiter_wakes_on_release_without_polling():
    pool = ConnectionPool(Factory(), size=1)
    held = pool.acquire()
    got: list[PairConnection] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    time.sleep(0.05)
    assert not got                      # blocked: the only connection is busy
    pool.release(held)
    waiter.join(2)
    assert got == [held]
    pool.release(held)
    pool.close()


def test_broken_connection_is_dropped_and_refilled():
    factory = Factory()
    pool = ConnectionPool(factory, size=1)
    conn = pool.acquire()
    conn.close()                        # the caller found it broken
    pool.release(conn)
    assert pool.open_connections == 0
    with pool.borrow() as fresh:
        assert fresh is not conn and not fresh.closed
    idle = pool.acquire()
    pool.release(idle)
    idle.close()                        # broke while idle
    with pool.borrow() as third:
        assert third is not idle
    assert len(factory.made) == 3
    pool.close()


def test_factory_failure_frees_the_slot():
    calls = []

    def flaky() -> PairConnection:
        calls.append(1)
        if len(calls) == 1:
            raise ServerUnavailable("refused")
        return PairConnection()

    pool = ConnectionPool(flaky, size=1)
    with pytest.raises(ServerUnavailable):
        pool.acquire()
    with pool.borrow() as conn:
        assert not conn.closed
    pool.close()


def test_close_closes_idle_and_returned_and_refuses_later():
    factory = Factory()
    pool = ConnectionPool(factory, size=2)
    a = pool.acquire()
    b = pool.acquire()
    pool.release(a)
    pool.close()
    assert a.closed and not b.closed    # b is still in use
    pool.release(b)
    assert b.closed
    with pytest.raises(ServerUnavailable, match="closed"):
        pool.acquire()
    pool.close()                        # idempotent


def test_close_wakes_waiters():
    pool = ConnectionPool(Factory(), size=1)
    held = pool.acquire()
    errors: list[BaseException] = []

    def wait():
        try:
            pool.acquire()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    pool.close()
    t.join(2)
    assert len(errors) == 1 and isinstance(errors[0], ServerUnavailable)
    pool.release(held)


def test_acquire_timeout():
    pool = ConnectionPool(Factory(), size=1, timeout=0.05)
    held = pool.acquire()
    with pytest.raises(Timeout):
        pool.acquire()
    pool.release(held)
    pool.close()


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_size(size):
    with pytest.raises(InvalidArgument):
        ConnectionPool(Factory(), size=size)


def test_release_of_foreign_connection():
    pool = ConnectionPool(Factory(), size=1)
    with pytest.raises(InvalidArgument):
        pool.release(PairConnection())
    pool.close()


def test_connection_broken_while_idle_is_closed_when_dropped():
    # a connection can report itself broken (its peer went away) without anyone having
    # called close(): the pool must still free what it holds when it drops it
    class Breakable(PairConnection):
        broken = False
        close_calls = 0

        @property
        def closed(self) -> bool:
            return self.broken or super().closed

        def close(self) -> None:
            self.close_calls += 1
            super().close()

    made: list[Breakable] = []
    pool = ConnectionPool(lambda: made.append(Breakable()) or made[-1], size=1)
    conn = pool.acquire()
    pool.release(conn)
    conn.broken = True
    with pool.borrow() as fresh:
        assert fresh is not conn
    assert conn.close_calls == 1 and conn.peer.fileno() < 0
    pool.close()


def test_waiters_are_served_in_turn_not_overtaken_by_a_busy_caller():
    """A caller that gives its connection back and asks again at once must not win it
    over a caller already waiting: with more threads than connections, each gets its
    turn (seen as a client thread stalled for the whole run while two others kept the
    pool's two connections)."""
    pool = ConnectionPool(Factory(), 1, timeout=5.0)   # starved: Timeout, not a hang
    stop = threading.Event()
    busy_rounds = 0

    def busy() -> None:
        nonlocal busy_rounds
        while not stop.is_set():
            with pool.borrow() as conn:
                conn.echo(b"x")
                time.sleep(0.001)
            busy_rounds += 1
    hog = threading.Thread(target=busy)
    hog.start()
    try:
        time.sleep(0.1)
        waits = []
        for _ in range(20):
            t0 = time.monotonic()
            with pool.borrow() as conn:
                waits.append(time.monotonic() - t0)
                conn.echo(b"y")
    finally:
        stop.set()
        hog.join()
    assert busy_rounds > 0
    # each turn waits for at most the one use in progress (about a millisecond)
    assert max(waits) < 0.5, waits
    pool.close()
