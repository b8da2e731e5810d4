"""Data-plane transports, a registry keyed by URI scheme.

A transport opens a :class:`Session` to one memory server for one region ticket. A
session moves bytes between caller buffers and extents on that server. ``tcp`` and
``shm`` ship here; ``rdma`` registers itself when pyverbs imports. Third parties add
one with :func:`register`.
"""
from __future__ import annotations

import abc
import logging
from typing import Callable, Sequence

from ..addressing import Endpoint
from ..dtypes import DType

log = logging.getLogger(__name__)


class Session(abc.ABC):
    """Operations on the extents of one memory server under one ticket.

    Offsets are extent offsets in bytes; ``buffers`` are byte memoryviews whose
    lengths add up to the length of the operation, in order (scatter/gather).
    A session owns its connections and closes them in :meth:`close`.
    """

    scheme: str = ""

    @abc.abstractmethod
    def write(self, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None: ...

    @abc.abstractmethod
    def read_into(self, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None: ...

    @abc.abstractmethod
    def accumulate(self, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None) -> None:
        """``extent += x`` (or ``extent += alpha * x`` when alpha is given)."""

    @abc.abstractmethod
    def scale(self, extent_id: int, offset: int, length: int, dtype: DType, alpha: float) -> None: ...

    @abc.abstractmethod
    def fetch_add(self, extent_id: int, offset: int, value: int) -> int: ...

    def fetch_add_many(self, extent_id: int, items: Sequence[tuple[int, int]]) -> list[int]:
        """``fetch_add`` of each ``(offset, value)``, in order; the old values. A
        transport that can keep several in flight overrides this."""
        return [self.fetch_add(extent_id, offset, value) for offset, value in items]

    @abc.abstractmethod
    def compare_swap(self, extent_id: int, offset: int, expected: int, desired: int) -> int: ...

    @abc.abstractmethod
    def close(self) -> None: ...


#: factory(endpoint, ticket_token, ticket_mode, options) -> Session
Factory = Callable[[Endpoint, str, str, dict], Session]
TRANSPORTS: dict[str, Factory] = {}


def register(scheme: str, factory: Factory) -> None:
    TRANSPORTS[scheme] = factory


def available() -> list[str]:
    return sorted(TRANSPORTS)


from . import tcp as _tcp  # noqa: E402  (registers itself)
from . import shm as _shm  # noqa: E402

try:  # optional: needs pyverbs from the distribution's rdma-core
    from . import rdma as _rdma  # noqa: F401
except ImportError as exc:
    log.debug("rdma transport unavailable: %s", exc)
