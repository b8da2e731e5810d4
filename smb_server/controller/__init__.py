"""The controller: cluster membership, the region table, placement and tickets.

- :mod:`.state` holds the durable state (SQLite, no gRPC, no sockets); its records and
  input checks are in :mod:`.records`;
- :mod:`.creation` is the create/delete sequence (reserve on servers, commit, roll back),
  written against the :class:`.memservers.MemoryServers` interface; :mod:`.memservers`
  holds its gRPC implementation;
- :mod:`.barriers` holds the in-memory barriers;
- :mod:`.service` is the gRPC servicer that translates messages into calls on those;
- :mod:`.main` runs the daemon (``smb controller``).
"""
from __future__ import annotations

__all__ = ["Controller", "ControllerState", "serve"]


def __getattr__(name: str) -> object:
    # Lazy, so that importing the pure state does not pull in gRPC.
    if name == "ControllerState":
        from .state import ControllerState
        return ControllerState
    if name in ("Controller", "serve"):
        from . import main
        return getattr(main, name)
    raise AttributeError(name)
