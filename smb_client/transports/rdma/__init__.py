"""The rdma data plane: RC queue pairs to a memory server, set up through its
``Connect`` gRPC call (``rdma://host:port`` names that gRPC service).

* ``read_into``/``write``: one-sided RDMA READ/WRITE between the caller's buffers and
  the extent's registration, split at the device's largest message, pipelined with a
  window of outstanding work requests (reads and atomics at most ``max_rd_atomic``),
  a completion requested every ``SIGNAL_EVERY`` requests and for the last one.
* ``fetch_add``/``compare_swap``: RDMA atomics on 8-byte aligned words. Soft-RoCE
  (rxe) makes them atomic only against other rxe atomics, not against the server's
  CPU (accumulate) or plain writes to the same word.
* ``accumulate``/``axpy``/``scale``: two-sided (:mod:`smb_protocol.rdma_wire`): the
  operand is RDMA-written into the connection's staging area on the server, then a
  small SEND asks the server to compute; its reply SEND ends the step. Operands
  larger than half the staging area go in chunks, two in flight.

One session per (client, server), shared by the client's regions; its queue pairs
(``connections`` option, a blocking pool) each carry every ticket presented on them:
a ticket is presented once per queue pair, before its first use, with a ``Connect``
call naming the queue pair, and the answer holds the rkeys that ticket allows.

Caller buffers are registered zero copy through a process-wide registration cache
keyed by the owning object (numpy array, mmap, torch storage). An error completion
breaks only its queue pair: it becomes a typed exception, the queue pair is destroyed
and the next operation connects again (once transparently, for errors a new
``Connect`` can fix). pyverbs calls hold the GIL, so completion queues are polled
with back-off rather than blocking on completion events.

Modules: :mod:`.device` (the process's devices), :mod:`.registration` (the cache),
:mod:`.connection` (one queue pair; :mod:`.peer`: what it knows of its server),
:mod:`.session` (the :class:`Session`).
"""
from __future__ import annotations

import logging

from smb_protocol.rdma import verbs

from .registration import RegistrationCache

log = logging.getLogger(__name__)

__all__ = ["RegistrationCache"]

# The transport registers itself only where pyverbs imports; the registration cache
# (pure bookkeeping) stays importable, and testable, without it.
if verbs.pyverbs_available():
    from .. import register
    from .connection import RdmaConnection
    from .peer import Broken, RemoteExtent
    from .session import RdmaSession

    __all__ += ["RdmaSession", "RdmaConnection", "RemoteExtent", "Broken"]
    register("rdma", RdmaSession)
else:
    log.debug("rdma transport unavailable: pyverbs is not installed "
              "(Debian/Ubuntu: apt-get install python3-pyverbs)")
