"""The controller's durable state: two stores with one interface, and :func:`open_state`
that picks one from a path or URL.

- :mod:`.protocol`: :class:`~.protocol.StateStore`, what the servicer, the region
  creator and the daemon call, and :class:`~.protocol.Leadership`, a shared store's side
  of the election;
- :mod:`.sqlite` (a file path or ``:memory:``): :class:`.sqlite.state.ControllerState`,
  the embedded default for one controller (``smb up``, single-node use);
- :mod:`.etcd` (``etcd://host:port[,host:port...][/prefix]``):
  :class:`.etcd.state.EtcdState`, for several controllers (one leader, standbys;
  :mod:`smb_server.controller.leader`).

Both apply the same pure rules (:mod:`smb_server.controller.rules`) to the same records
(:mod:`smb_server.controller.records`); neither imports the servicer.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .protocol import StateStore

__all__ = ["open_state"]

log = logging.getLogger(__name__)


def open_state(where: str, lease_seconds: float = 5.0, orphan_grace_seconds: float = 30.0,
               recover: bool = True) -> StateStore:
    """Open the store at ``where`` (a SQLite path or an ``etcd://`` URL); the caller
    closes it. ``recover`` (etcd only): remove half-created regions now; a standby
    passes False (the SQLite file has one controller, which always recovers)."""
    # imported here, so that importing one store does not import the other (or gRPC)
    from .etcd.kv import is_etcd_url
    if is_etcd_url(where):
        from .etcd.state import EtcdState
        return EtcdState(where, lease_seconds, orphan_grace_seconds, recover=recover)
    from .sqlite.state import ControllerState
    return ControllerState(where, lease_seconds, orphan_grace_seconds)
