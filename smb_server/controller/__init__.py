"""The controller: cluster membership, the region table, placement and tickets.

- :mod:`.state` holds the durable state (SQLite, no gRPC, no sockets);
- :mod:`.service` is the gRPC servicer that translates messages into state calls and
  reserves/releases extents on memory servers;
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
