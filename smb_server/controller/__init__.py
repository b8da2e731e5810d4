"""The controller: cluster membership, the region table, placement and tickets.

The state (no gRPC, no sockets):

- :mod:`.records`: the records (servers, regions, extents), the checks on what callers
  send, and :class:`~.records.CreateRequest`, a region's create request as the servicer,
  the creator and the stores pass it;
- :mod:`.rules`: the rules both stores apply, pure functions from records to changes;
- :mod:`.stores`: the stores behind one interface (:mod:`.stores.protocol`) and
  :func:`.stores.open_state`: :mod:`.stores.sqlite` (one file, one controller) and
  :mod:`.stores.etcd` (several controllers);
- :mod:`.leader`: the election among controllers that share an etcd store, and the gate
  that keeps a standby from serving.

What the leader does with it:

- :mod:`.creation`: the create/delete sequence (reserve on servers, commit, roll back),
  written against the :class:`.memservers.MemoryServers` interface; :mod:`.memservers`
  holds its gRPC implementation;
- :mod:`.repair`: keeping replica sets in step with their servers, and carrying out
  moves; its pure decisions are in :mod:`.repair_plans`, :mod:`.moves` (evacuations, the
  rebalance's byte moves) and :mod:`.heads` (role swaps); :mod:`.rebalancer` keeps an
  asked-for rebalance in the leader's memory; :mod:`.repair_metrics` counts what repairs did;
- :mod:`.barriers`: the in-memory barriers.

Serving it:

- :mod:`.service`: the gRPC servicer that translates messages into calls on those;
- :mod:`.main`: the daemon (``smb controller``).
"""
from __future__ import annotations

__all__ = ["Controller", "ControllerState", "serve"]


def __getattr__(name: str) -> object:
    # Lazy, so that importing the pure state does not pull in gRPC.
    if name == "ControllerState":
        from .stores.sqlite.state import ControllerState
        return ControllerState
    if name in ("Controller", "serve"):
        from . import main
        return getattr(main, name)
    raise AttributeError(name)
