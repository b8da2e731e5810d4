"""The listener's admission ledger on its own: pending connections have a budget of
their own, the oldest of the peer holding the most is evicted, and only authenticated
connections count against the per-peer and total limits."""
from __future__ import annotations

import socket

import pytest

from smb_protocol.errors import ServerBusy
from smb_server.memserver.admission import COUNTED, EVICTED, PENDING, Admission, Ledger


@pytest.fixture
def socks():
    made: list[socket.socket] = []

    def make() -> socket.socket:
        made.append(socket.socket())
        return made[-1]

    yield make
    for s in made:
        s.close()


def admission(ledger: Ledger, socks, key: str) -> Admission:
    return Admission(socks(), key, f"{key}:1", lambda a: None)


def test_pending_connections_count_against_their_own_budget_only(socks):
    ledger = Ledger(max_connections=2, max_per_peer=1, max_unauthenticated=3,
                    unauthenticated_setting="x_unauthenticated")
    pending = [admission(ledger, socks, "a") for _ in range(3)]
    assert [ledger.add(p) for p in pending] == [None, None, None]
    assert ledger.pending == 3 and ledger.counted == 0
    assert ledger.refusal("a") is None                 # none of them counts per peer
    newer = admission(ledger, socks, "a")
    assert ledger.add(newer) is pending[0]              # the oldest goes
    assert pending[0].state == EVICTED and ledger.pending == 3
    err = ledger.authenticate(pending[0])
    assert isinstance(err, ServerBusy) and "x_unauthenticated" in str(err)
    assert ledger.authenticate(pending[1]) is None      # counted now
    assert pending[1].state == COUNTED and ledger.pending == 2 and ledger.counted == 1
    assert ledger.authenticate(pending[1]) is None      # idempotent
    refused = ledger.authenticate(pending[2])           # the peer's share (1) is taken
    assert isinstance(refused, ServerBusy) and pending[2].state == PENDING
    ledger.remove(pending[1])
    assert ledger.counted == 0 and ledger.authenticate(pending[2]) is None


def test_the_victim_is_the_oldest_of_the_peer_holding_the_most(socks):
    ledger = Ledger(max_connections=10, max_per_peer=None, max_unauthenticated=3)
    mine = admission(ledger, socks, "client")
    ledger.add(mine)
    flood = [admission(ledger, socks, "attacker") for _ in range(2)]
    for a in flood:
        ledger.add(a)
    assert ledger.add(admission(ledger, socks, "attacker")) is flood[0]
    assert ledger.add(admission(ledger, socks, "client")) is flood[1]
    assert mine.state == PENDING


def test_without_a_budget_every_connection_counts_from_its_accept(socks):
    ledger = Ledger(max_connections=1, max_per_peer=None, max_unauthenticated=None,
                    max_setting="x_max")
    first = admission(ledger, socks, "a")
    assert ledger.add(first) is None and first.state == COUNTED
    err = ledger.refusal("b")
    assert isinstance(err, ServerBusy) and "x_max" in str(err)
    ledger.remove(first)
    assert ledger.refusal("b") is None
