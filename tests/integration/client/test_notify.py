"""Waits on int64 words served by the memory servers, over tcp and shm: woken by every
mutating operation that touches the word, typed errors for bad input and timeouts, and
a waiting request never blocks the other requests of its client."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from smb_client.transports.tcp import TcpConnection
from smb_protocol import errors, wire
from tests.integration.memserver.planes import typed

MiB = 1 << 20
WORD = 4096          # byte offset of the watched word
JOIN = 30.0          # seconds a woken waiter gets to return (generous: a shared, loaded machine)


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    return request.param


@pytest.fixture
def region(cluster, name, transport):
    with cluster.client(transport=transport) as c:
        r = c.create_region(name, 2 * MiB, placement="single")
        assert set(r.transports().values()) == {transport}
        yield r
        c.delete_region(name)


class Waiter(threading.Thread):
    """Runs ``region.wait(...)`` in a thread; ``result`` is the word or the error."""

    def __init__(self, region, offset=WORD, **kwargs) -> None:
        super().__init__(daemon=True)
        self.region, self.offset, self.kwargs = region, offset, kwargs
        self.result: object = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.region.wait(self.offset, **self.kwargs)
        except Exception as exc:
            self.result = exc

    def outcome(self) -> object:
        self.join(JOIN)
        assert not self.is_alive(), "the waiter was never woken"
        return self.result


def _word(region, offset=WORD) -> int:
    return int(region.read(offset, 8, dtype="int64")[0])


def test_wait_returns_once_fetch_add_reaches_the_value(region):
    w = Waiter(region, value=3, timeout=60)
    for _ in range(3):
        region.fetch_add(WORD, 1)
    assert w.outcome() == 3


MUTATIONS = {
    "fetch_add": lambda r: r.fetch_add(WORD, 5),
    "compare_swap": lambda r: r.compare_swap(WORD, 0, 5),
    "accumulate": lambda r: r.accumulate(WORD - 16, np.array([0, 0, 5, 0], np.int64)),
    "write": lambda r: r.write(WORD, np.array([5], np.int64)),
    "axpy": lambda r: r.axpy(WORD, np.array([5.0], np.float64), 1.0),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_every_mutating_operation_wakes_a_wait_on_its_word(region, mutation):
    """``changed_from=0``: any change wakes it (shm writes are seen by the server's re-read)."""
    w = Waiter(region, changed_from=0, timeout=60)
    MUTATIONS[mutation](region)
    got = w.outcome()
    assert got == _word(region) != 0


def test_equals_waits_for_that_exact_value(region):
    region.write(WORD, np.array([10], np.int64))
    w = Waiter(region, equals=12, timeout=60)
    region.fetch_add(WORD, 1)            # 11: not yet
    region.fetch_add(WORD, 1)            # 12
    assert w.outcome() == 12


def test_a_condition_already_true_returns_at_once(region):
    region.write(WORD, np.array([7], np.int64))
    assert region.wait(WORD, value=7, timeout=0) == 7
    assert region.wait(WORD, changed_from=3, timeout=0) == 7
    assert region.wait(WORD, equals=7) == 7


def test_a_write_elsewhere_leaves_the_wait_waiting(region):
    w = Waiter(region, value=1, timeout=60)
    region.write(WORD + 8, np.array([99], np.int64))          # the next word
    region.fetch_add(WORD - 8, 1)                             # the previous word
    region.fetch_add(WORD, 1)
    assert w.outcome() == 1


def test_timeout_raises_timeout_and_the_server_stays_up(region):
    t0 = time.monotonic()
    with pytest.raises(errors.Timeout) as info:
        region.wait(WORD, value=1, timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    assert "is 0" in str(info.value)
    region.fetch_add(WORD, 1)
    assert region.wait(WORD, value=1, timeout=5) == 1


def test_many_waiters_are_woken_by_one_change(region):
    waiters = [Waiter(region, value=1, timeout=60) for _ in range(8)]
    region.fetch_add(WORD, 1)
    assert [w.outcome() for w in waiters] == [1] * 8


def test_a_pending_wait_blocks_no_other_request(cluster, name, transport):
    """With one data connection per server, reads, writes and atomics still run while
    waits are pending: waits have connections of their own."""
    with cluster.client(transport=transport, connections=1) as c:
        r = c.create_region(name, MiB, placement="single")
        waiters = [Waiter(r, value=100, timeout=60) for _ in range(3)]
        r.write(0, np.arange(16, dtype=np.int64))
        assert r.read(0, 128, dtype="int64").tolist() == list(range(16))
        for _ in range(100):
            r.fetch_add(WORD, 1)
        assert [w.outcome() for w in waiters] == [100] * 3
        c.delete_region(name)


@pytest.mark.parametrize("kwargs,error", [
    ({"offset": WORD + 4, "value": 1}, errors.Misaligned),
    ({"offset": 2 * MiB, "value": 1}, errors.OutOfRange),
    ({"offset": WORD}, errors.InvalidArgument),
    ({"offset": WORD, "value": 1, "equals": 1}, errors.InvalidArgument),
    ({"offset": WORD, "value": 1, "timeout": -1}, errors.InvalidArgument),
])
def test_bad_waits_are_refused_with_typed_errors(region, kwargs, error):
    kwargs = dict(kwargs)
    offset = kwargs.pop("offset")
    with pytest.raises(error):
        region.wait(offset, **kwargs)
    region.fetch_add(WORD, 1)                        # still served
    assert region.wait(WORD, value=1, timeout=5) == 1


def test_a_read_only_handle_can_wait(cluster, region):
    with cluster.client() as other:
        ro = other.open_region(region.name, "ro")
        w = Waiter(ro, value=2, timeout=60)
        region.fetch_add(WORD, 2)
        assert w.outcome() == 2


def test_deleting_the_region_ends_a_wait_with_extent_not_found(cluster, name, transport):
    with cluster.client(transport=transport) as c:
        r = c.create_region(name, MiB, placement="single")
        w = Waiter(r, value=1, timeout=60)
        time.sleep(0.2)                  # let the wait reach the server (else it fails to start: same error)
        c.delete_region(name)
        assert isinstance(w.outcome(), errors.RegionNotFound)


def _raw(region):
    """A bare tcp connection to the region's server, with its ticket presented."""
    place = region.extents[0]
    tcp = next(u for u in place.endpoints if u.startswith("tcp://"))
    host, port = tcp[len("tcp://"):].rsplit(":", 1)
    conn = TcpConnection(host, int(port))
    conn.present(region.route.ticket)
    return conn, place.extent_id


def test_wire_wait_with_an_unknown_condition_is_refused_and_the_connection_stays(region):
    conn, extent_id = _raw(region)
    try:
        with pytest.raises(errors.InvalidArgument, match="wait condition"):
            conn.request(typed(wire.Op.WAIT, extent_id, WORD, 8, dtype=9, alpha=1.0))
        with pytest.raises(errors.InvalidArgument):
            conn.request(typed(wire.Op.WAIT, extent_id, WORD, 16, dtype=int(wire.WaitCond.EQUAL), alpha=1.0))
        with pytest.raises(errors.InvalidArgument, match="timeout"):
            conn.request(typed(wire.Op.WAIT, extent_id, WORD, 8, dtype=1, alpha=float("nan")))
        body = conn.request(typed(wire.Op.WAIT, extent_id, WORD, 8, dtype=int(wire.WaitCond.EQUAL), arg0=0,
                                  alpha=1.0))
        assert struct.unpack("<q", body)[0] == 0
    finally:
        conn.close()


def test_a_client_that_hangs_up_mid_wait_leaves_the_server_serving(region):
    conn, extent_id = _raw(region)
    conn.sock.sendall(wire.pack_request(wire.Op.WAIT, 1, extent_id, WORD, 8, dtype=1, arg0=1, alpha=60.0))
    time.sleep(0.1)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    w = Waiter(region, value=1, timeout=60)
    region.fetch_add(WORD, 1)
    assert w.outcome() == 1
