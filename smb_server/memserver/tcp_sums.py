"""The sums a tcp connection owes for its ``REDUCE`` requests (:mod:`.tcp_plane`).

Where a sum is sent from, fewest threads woken first:

* the push that completes the round sends its own sum from the reading thread, right
  behind its ``PUSHED`` answer (one segment);
* an earlier push parks its sum (:mod:`.parked`); the completing push, whichever
  connection or plane it came on, sends it from its own thread when the owner's socket
  has room for it at once and no other thread is sending there, else hands it to the
  owner's deliveries thread (:mod:`.deliveries`), which sends it, blocking if it must;
* the parking watchdog hands back a sum whose deadline passed (answered ``Timeout`` by
  the deliveries thread), whose extent went or whose round completed unseen (served
  by the deliveries thread as before parking existed), or whose connection ended
  (dropped: the client asks again on a new connection).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Protocol

from smb_protocol import requests, wire
from smb_protocol.errors import SMBError

from . import collective_ops
from .deliveries import Deliveries
from .parked import Key
from .peer import Peer

if TYPE_CHECKING:
    from .arena import Extent
    from .node import Node

log = logging.getLogger(__name__)

SO_MEMINFO = 55               # Linux: a socket's memory, as u32 fields (sock_diag's SK_MEMINFO_*)
_MEMINFO = struct.Struct("9I")
_SNDBUF, _WMEM_QUEUED = 3, 5
FULL_LOOK = 20      # the watchdog's looks at a parked sum between looks at its round
LOCK_WAIT = 0.002   # seconds a completing push waits for another answer on the same connection to go out


class Owner(Peer, Protocol):
    """What a parked sum needs of its connection (a :class:`.peer.Peer`)."""

    sock: socket.socket
    ended: bool

    @property
    def sending(self) -> threading.RLock: ...

    def deliver(self, pull: requests.Pull) -> None: ...

    def owed(self) -> Deliveries[requests.Pull]: ...


def room(sock: socket.socket) -> int:
    """Bytes of memory the socket's send buffer has left (its size less what its queued
    bytes take in the kernel, buffers' overhead included: ``SO_MEMINFO``)."""
    info = _MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size))
    return int(info[_SNDBUF]) - int(info[_WMEM_QUEUED])


class OwedSum:
    """A sum parked until its round is complete (:class:`.parked.Owed`)."""

    __slots__ = ("owner", "node", "extent", "pull", "key", "deadline", "looks")

    def __init__(self, owner: Owner, node: Node, extent: Extent, pull: requests.Pull) -> None:
        self.owner = owner
        self.node = node
        self.extent = extent
        self.pull = pull
        self.key: Key = (pull.extent_id, pull.ref.word, pull.ref.round)
        self.deadline = time.monotonic() + pull.timeout
        self.looks = 0

    def send(self) -> None:
        owner = self.owner
        if owner.ended:
            return
        nbytes = self.pull.length + wire.RESPONSE.size
        if owner.sending.acquire(timeout=LOCK_WAIT):
            try:
                if room(owner.sock) >= 2 * nbytes:   # a buffer's overhead: about 40 % on loopback
                    owner.deliver(self.pull)
                    return
            except OSError:   # the socket went: its reading thread ends the connection
                return
            finally:
                owner.sending.release()
        owner.owed().put(self.pull)

    def overdue(self) -> bool:
        """Its connection ended, its deadline passed or its extent went (looked at every
        time, as a wait does), or its round completed unseen (every FULL_LOOK-th time:
        every completion takes its round's sums, so this is only a safety net)."""
        self.looks += 1
        return (self.owner.ended or time.monotonic() >= self.deadline or not self.extent.live
                or (self.looks % FULL_LOOK == 0 and collective_ops.ready(self.node, self.owner, self.pull)))

    def hand_back(self) -> None:
        owner, pull = self.owner, self.pull
        if owner.ended:
            return
        left = self.deadline - time.monotonic()
        if left > 0 or collective_ops.ready(self.node, owner, pull):
            owner.owed().put(dataclasses.replace(pull, timeout=max(left, 0.0)))
            return
        err: SMBError = collective_ops.absent(pull.extent_id, pull.word, pull.ref.ready, pull.timeout)
        owner.owed().refuse(pull, err)


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
    owed = OwedSum(owner, node, extent, pull)
    node.parked.park(owed)
    if collective_ops.ready(node, owner, pull) and node.parked.reclaim(owed):
        owner.deliver(pull)   # completed meanwhile, and its push left this one here
