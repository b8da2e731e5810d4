"""Data-plane transports, a registry keyed by URI scheme.

A transport opens a :class:`Session` to one memory server endpoint, shared by every
region of a client. A session moves bytes between caller buffers and extents on that
server. ``tcp`` and
``shm`` ship here; ``rdma`` registers itself when pyverbs imports. Third parties add
one with :func:`register`.
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from smb_protocol.addressing import Endpoint
from smb_protocol.dtypes import DType
from smb_protocol.errors import InvalidArgument
from smb_protocol.rounds import ChunkRound

if TYPE_CHECKING:
    from .stream import Reducer

log = logging.getLogger(__name__)


class Session(abc.ABC):
    """Operations on the extents of one memory server, for every region of one client.

    One session per (client, endpoint URI), shared by all the client's regions on that
    server. Each operation carries the region's ticket token first; the session presents
    a token on a connection (once per connection, before the first request that needs
    it) and may keep many tokens per connection. A renewed ticket is just a new token.

    Offsets are extent offsets in bytes; ``buffers`` are byte memoryviews whose
    lengths add up to the length of the operation, in order (scatter/gather).
    A session owns its connections and closes them in :meth:`close`.

    ``seq`` on a mutating operation is its sequence number from
    :meth:`~smb_client.dataplane.DataPlane.next_seq` (0: not tracked). A session may send
    a numbered request again (for example on a new connection after one broke) and the
    server applies it at most once; an operation it splits into several messages numbers
    them ``seq + k``.
    """

    scheme: str = ""

    @abc.abstractmethod
    def write(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
              seq: int = 0) -> None: ...

    @abc.abstractmethod
    def read_into(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview]) -> None: ...

    @abc.abstractmethod
    def accumulate(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
                   dtype: DType, alpha: float | None = None, seq: int = 0) -> None:
        """``extent += x`` (or ``extent += alpha * x`` when alpha is given)."""

    @abc.abstractmethod
    def scale(self, ticket: str, extent_id: int, offset: int, length: int, dtype: DType,
              alpha: float, seq: int = 0) -> None: ...

    @abc.abstractmethod
    def fetch_add(self, ticket: str, extent_id: int, offset: int, value: int, seq: int = 0) -> int: ...

    def fetch_add_many(self, ticket: str, extent_id: int, items: Sequence[tuple[int, int]],
                       seq: int = 0) -> list[int]:
        """``fetch_add`` of each ``(offset, value)``, in order; the old values (word k
        numbered ``seq + k``). A transport that can keep several in flight overrides this."""
        return [self.fetch_add(ticket, extent_id, offset, value, seq + k if seq else 0)
                for k, (offset, value) in enumerate(items)]

    @abc.abstractmethod
    def compare_swap(self, ticket: str, extent_id: int, offset: int, expected: int, desired: int,
                     seq: int = 0) -> int: ...

    # -- coordination: requests that wait at the server (see smb_client.coord) ----------
    # Served by the tcp plane, whose session keeps connections of their own for them (a
    # waiting request holds its connection until it is answered); other sessions send
    # them through their server's tcp session or refuse them.

    def wait(self, ticket: str, extent_id: int, offset: int, cond: int, target: int,
             timeout: float) -> int:
        """Block at the server until the int64 at ``offset`` meets ``cond`` (a
        :class:`~smb_protocol.wire.WaitCond`) against ``target``, up to ``timeout``
        seconds (then :class:`~smb_protocol.errors.Timeout`); returns the word then."""
        raise self._no_coordination("wait")

    def lock(self, ticket: str, extent_id: int, offset: int, holder: int, lease: float,
             timeout: float) -> int:
        """Take the lock word at ``offset`` for ``holder`` (non-zero) with a lease of
        ``lease`` seconds, or renew it, waiting up to ``timeout`` seconds while another
        holder's lease runs (then Timeout); returns the word before (0: it was free)."""
        raise self._no_coordination("lock")

    def unlock(self, ticket: str, extent_id: int, offset: int, holder: int) -> int:
        """Free the lock word at ``offset`` held by ``holder`` (LockNotHeld otherwise)."""
        raise self._no_coordination("unlock")

    def push(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview], dtype: int,
             ref: ChunkRound, timeout: float, seq: int = 0) -> int:
        """A collective's ``PUSH`` of ``buffers`` at ``offset`` into the round ``ref``
        names (see :data:`smb_protocol.wire.COLLECTIVE_OPS`), waiting up to ``timeout``
        seconds for the slot; the count word before. ``dtype``: the chunk's types
        (:meth:`smb_protocol.chunk_types.ChunkTypes.code`; a DType for a plain chunk)."""
        raise self._no_coordination("push")

    def pull(self, ticket: str, extent_id: int, offset: int, buffers: Sequence[memoryview],
             ref: ChunkRound, timeout: float, seq: int = 0, dtype: int = 0, length: int | None = None) -> None:
        """A collective's ``PULL`` of the round ``ref`` names into ``buffers``, waiting up
        to ``timeout`` seconds for every push (see :data:`smb_protocol.wire.COLLECTIVE_OPS`).
        ``dtype``: the chunk's types (0: the slot's bytes as they are); ``length``: the
        chunk's pushed bytes (default: the buffers' size)."""
        raise self._no_coordination("pull")

    def reductions(self) -> Reducer | None:
        """The pipelined stream for a collective's ``REDUCE`` requests to this server
        (:mod:`.stream`), or None where the session has none (a collective then pushes
        and pulls)."""
        return None

    def _no_coordination(self, what: str) -> InvalidArgument:
        return InvalidArgument(f"a {self.scheme or type(self).__name__} session does not serve {what}: "
                               "coordination goes over the server's tcp session")

    @abc.abstractmethod
    def close(self) -> None: ...


#: factory(endpoint, options) -> Session. Options: ``connections`` (per session),
#: ``grpc_address`` (the memory server's), ``token`` (the client's bearer token), the
#: user's ``transport_options``, and for shm ``arithmetic``: a callable returning the tcp
#: Session of the same server at the endpoint the controller lists now (borrowed, not
#: closed by the shm session) for server-side arithmetic.
Factory = Callable[[Endpoint, dict[str, Any]], Session]
TRANSPORTS: dict[str, Factory] = {}


def register(scheme: str, factory: Factory) -> None:
    TRANSPORTS[scheme] = factory


def available() -> list[str]:
    return sorted(TRANSPORTS)


from . import shm as _shm  # noqa: E402, F401  (registers itself)
from . import tcp as _tcp  # noqa: E402, F401  (registers itself)

try:  # optional: needs pyverbs from the distribution's rdma-core
    from . import rdma as _rdma  # noqa: F401
except ImportError as exc:
    log.debug("rdma transport unavailable: %s", exc)
