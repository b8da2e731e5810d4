"""The sums a tcp connection owes for the ``REDUCE`` requests Python served (:mod:`.tcp_plane`;
most are served natively, ``native/serve.c``, which owes and sends its own the same way).

Where a sum is sent from, fewest threads woken first:

* the push that completes the round sends its own sum right behind its ``PUSHED``
  answer (one segment);
* an earlier push parks its sum natively (``Conn.owe``); the push that completes the
  round, whichever connection or plane it came on, native or Python, sends every sum
  parked for the round from its own thread, without the interpreter; one it cannot
  send at once (that connection's socket full, or another answer going out there) goes
  to that connection's own native loop, which sends it between its frames, waiting for
  room;
* a parked sum whose deadline passed, whose extent went or was blocked, or that cannot
  be sent the simple way (its pull's number seen before) is handed back to its
  connection, which serves it on its deliveries thread (:mod:`.deliveries`) as a pull:
  answered, or refused with ``Timeout`` once its deadline passed (:func:`hand_back`);
  one whose connection ended is dropped (the client asks again on a new connection).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from smb_protocol import requests
from smb_protocol.errors import SMBError

from . import _native, collective_ops
from .deliveries import Deliveries
from .peer import Peer

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger(__name__)


class Owner(Peer, Protocol):
    """What an owed sum needs of its connection (a :class:`.peer.Peer`)."""

    ended: bool

    @property
    def native(self) -> _native.Conn | None: ...

    def deliver(self, pull: requests.Pull) -> None: ...

    def owed(self) -> Deliveries[requests.Pull]: ...


def owe(owner: Owner, node: Node, req: requests.Reduce, last: bool) -> None:
    """Owe the sum of the pushed ``req``: sent at once from here when its push was the
    round's ``last``, else parked until the push that completes the round."""
    pull = req.pull()
    try:
        extent = node.arena.get(pull.extent_id)
    except SMBError:
        last = True   # gone already: the pull answers why
    if last:
        owner.deliver(pull)
        return
    ref = pull.ref
    assert owner.native is not None   # a REDUCE is refused over TLS, the only plane without one
    owner.native.owe(extent.native, pull.req_id, pull.offset, pull.length, pull.client, pull.seq, ref.word,
                     ref.parties, ref.round, pull.dtype, pull.timeout)


def hand_back(owner: Owner, node: Node, pull: requests.Pull, left: float) -> None:
    """Serve a sum the native side handed back (``left``: seconds to its deadline) on
    the owner's deliveries thread: as a pull while its deadline has not passed or its
    round is complete, else refused with ``Timeout``."""
    if owner.ended:
        return
    if left > 0 or collective_ops.ready(node, owner, pull):
        owner.owed().put(pull)
        return
    owner.owed().refuse(pull, collective_ops.absent(pull.extent_id, pull.word, pull.ref.ready, pull.timeout))
