"""The interface both state stores offer (:class:`StateStore`), and the part of it that
only a store shared by several controllers has (:class:`Leadership`); the stores are
:class:`.sqlite.state.ControllerState` and :class:`.etcd.state.EtcdState`, picked by
:func:`smb_server.controller.stores.open_state`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..records import CreateRequest, DeletedRegion, ExtentRecord, HeldExtent, RegionRecord, ServerRecord, SlotChange

if TYPE_CHECKING:
    from ..leader import Election
    from .etcd.txn import Fence

log = logging.getLogger(__name__)

SERVER_STATES = ("up", "down", "draining")   # the states a store keeps for a memory server


class Leadership(Protocol):
    """A store's side of leadership where several controllers share it (etcd): they
    elect one leader (:mod:`.leader`), and the store takes writes from it alone. It also
    keeps barriers' generations (:class:`.barriers.GenerationStore`), which outlive a leader."""

    def stand_by(self) -> None:
        """Refuse every write until :meth:`take_over` (a controller that has not won)."""
        ...

    def election(self, address: str, lease_seconds: float) -> Election:
        """This controller's part in the election, on the store's channel; ``address``:
        where clients reach it, ``lease_seconds``: how long a silent leader leads."""
        ...

    def take_over(self, fence: Fence, now: float | None = None) -> None:
        """Start leading with ``fence`` (every write checks it); clean what a dead leader
        left half-done."""
        ...

    def step_down(self) -> None:
        """Stop leading: writes are refused until the next :meth:`take_over`."""
        ...

    def barrier_generation(self, name: str) -> tuple[int, tuple[str, ...]]: ...

    def open_barrier(self, name: str, generation: int, arrivals: Sequence[str]) -> None: ...


class StateStore(Protocol):
    """What the servicer, the region creator and the daemon call; see
    :class:`.sqlite.state.ControllerState` for each method's contract."""

    path: str
    lease_seconds: float          # seconds a silent memory server stays up
    orphan_grace_seconds: float   # seconds before an unknown held extent is an orphan

    @property
    def leadership(self) -> Leadership | None:
        """None where this controller is the store's only one and always leads (SQLite);
        else the store's side of the election among its controllers."""
        ...

    def close(self) -> None: ...

    def register_server(self, server_id: str, host_id: str, grpc_address: str,
                        endpoints: Sequence[str], capacity: int,
                        held: Iterable[HeldExtent] = (), now: float | None = None
                        ) -> tuple[str, list[int]]: ...

    def heartbeat(self, server_id: str, held: Iterable[HeldExtent] = (),
                  now: float | None = None) -> list[int]: ...

    def expire_leases(self, now: float | None = None) -> list[str]: ...

    def unregister(self, server_id: str, reason: str = "") -> ServerRecord: ...

    def drain(self, server_id: str, undrain: bool = False, evacuate: bool = False) -> ServerRecord: ...

    def remove_server(self, server_id: str) -> ServerRecord: ...

    def get_server(self, server_id: str) -> ServerRecord: ...

    def list_servers(self) -> list[ServerRecord]: ...

    def begin_create_region(self, request: CreateRequest, now: float | None = None) -> RegionRecord: ...

    def commit_region(self, name: str, uid: str | None = None) -> RegionRecord: ...

    def abort_region(self, name: str, uid: str | None = None) -> list[ExtentRecord]: ...

    def get_region(self, name: str) -> RegionRecord: ...

    def delete_region(self, name: str, request_id: str = "", now: float | None = None
                      ) -> list[ExtentRecord]: ...

    def deleted_by(self, name: str, request_id: str) -> DeletedRegion | None: ...

    def list_regions(self, prefix: str = "") -> list[RegionRecord]: ...

    def change_slot(self, name: str, uid: str, change: SlotChange
                    ) -> tuple[RegionRecord, list[ExtentRecord]] | None: ...

    def lease_region(self, name: str, owner: str, seconds: float, now: float | None = None) -> None: ...

    def renew_lease(self, owner: str, now: float | None = None) -> int: ...

    def expired_leases(self, now: float | None = None) -> list[str]: ...

