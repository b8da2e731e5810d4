"""Data-plane requests as typed objects whose arguments have names, on both sides.

A client builds the request it means (:class:`Read`, :class:`Arithmetic`,
:class:`Lock`, ...) and sends :meth:`Request.to_frame`; a memory server's plane decodes
each request once (a tcp frame header, :func:`from_frame`, or an rdma message,
:func:`from_message`) and hands the object to its engine. The wire formats pack
arguments into a few generic fields (``dtype``, ``arg0``, ``arg1``, ``alpha``, see
:mod:`smb_protocol.wire`) whose meaning depends on the operation; this module is the one
place that knows which is which, both ways, and converts units (a lock's lease travels
in milliseconds). A primary forwards a piece to its backups as the typed piece it is.

Forwarded pieces (``smb_server/memserver/replica_ops.py``): a ranged mutation forwarded
by a primary carries the client request's range (``whole``), so a backup files the piece
under that request; a forwarded ``LOCK``/``UNLOCK`` carries the new word and the
primary's answer (:class:`LockPiece`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import ClassVar

from .rdma_wire import MsgOp
from .rounds import ChunkRound
from .wire import TRACED, Op, pack_request


class Arith(enum.Enum):
    """The server-side vector operations every data plane offers."""

    ACCUMULATE = "accumulate"   # dst += src
    AXPY = "axpy"               # dst += alpha * src
    SCALE = "scale"             # dst *= alpha


@dataclass(slots=True)
class Request:
    """What every request has. ``offset``/``length``: bytes in the extent; ``client``
    and ``seq``: the exactly-once numbering (0: not numbered)."""

    op: Op
    req_id: int = 0
    extent_id: int = 0
    offset: int = 0
    length: int = 0
    client: int = 0
    seq: int = 0
    #: a mutation that came over a replica ticket: a piece its primary forwards
    forwarded: bool = False
    #: the W3C traceparent the request arrived with (a sampled trace's), else None
    trace: bytes | None = None

    #: whether the request carries ``length`` payload bytes after its header
    payload: ClassVar[bool] = False

    def what(self) -> tuple[int, ...]:
        """What the exactly-once table files the request under: a sequence number reused
        for another request is refused, not answered for the wrong one."""
        return (int(self.op), self.extent_id, self.offset, self.length, self.dtype_code())

    def dtype_code(self) -> int:
        return 0

    def args(self) -> tuple[int, int, float]:
        """The generic wire fields ``(arg0, arg1, alpha)`` of this request (with
        :meth:`dtype_code` as the frame's ``dtype``)."""
        return 0, 0, 0.0

    def to_frame(self, req_id: int | None = None, traced: bool = False) -> bytes:
        """The request's tcp frame header (``req_id``: the connection's number for it,
        default its own); ``client`` travels only with a numbered request. ``traced``:
        a traceparent follows it (:data:`~smb_protocol.wire.TRACED`)."""
        arg0, arg1, alpha = self.args()
        return pack_request(self.op | TRACED if traced else self.op,
                            self.req_id if req_id is None else req_id, self.extent_id, self.offset,
                            self.length, self.dtype_code(), arg0, arg1, alpha,
                            client=self.client if self.seq else 0, seq=self.seq)

    def aimed(self, extent_id: int) -> Request:
        """The same request on extent ``extent_id`` (a primary's piece for a backup's copy)."""
        return replace(self, extent_id=extent_id)


@dataclass(slots=True)
class Hello(Request):
    """Presents a ticket (the payload)."""
    payload: ClassVar[bool] = True


@dataclass(slots=True)
class Ping(Request):
    pass


@dataclass(slots=True)
class Read(Request):
    pass


@dataclass(slots=True)
class Write(Request):
    """Stores the payload. ``whole``: for a piece a primary forwarded, the client
    request's (offset, length) it belongs to."""
    whole: tuple[int, int] = (0, 0)
    payload: ClassVar[bool] = True

    def args(self) -> tuple[int, int, float]:
        return self.whole[0], self.whole[1], 0.0


@dataclass(slots=True)
class Arithmetic(Request):
    """``ACCUMULATE`` (dst += x), ``AXPY`` (dst += alpha * x) or ``SCALE`` (dst *= alpha)
    of elements of ``dtype``; the operand is the payload (none for SCALE)."""
    arith: Arith = Arith.ACCUMULATE
    dtype: int = 0
    alpha: float = 0.0
    whole: tuple[int, int] = (0, 0)

    @property
    def carries(self) -> bool:
        return self.arith is not Arith.SCALE

    def dtype_code(self) -> int:
        return self.dtype

    def args(self) -> tuple[int, int, float]:
        return self.whole[0], self.whole[1], self.alpha


@dataclass(slots=True)
class FetchAdd(Request):
    value: int = 0

    def args(self) -> tuple[int, int, float]:
        return self.value, 0, 0.0


@dataclass(slots=True)
class CompareSwap(Request):
    expected: int = 0
    desired: int = 0

    def args(self) -> tuple[int, int, float]:
        return self.expected, self.desired, 0.0


@dataclass(slots=True)
class Wait(Request):
    """Until the word meets ``cond`` (a :class:`~smb_protocol.wire.WaitCond` code)
    against ``value``, at most ``timeout`` seconds."""
    cond: int = 0
    value: int = 0
    timeout: float = 0.0

    def dtype_code(self) -> int:
        return self.cond

    def args(self) -> tuple[int, int, float]:
        return self.value, 0, self.timeout


@dataclass(slots=True)
class Lock(Request):
    """Take or renew the lock word for ``holder`` for ``lease`` seconds, waiting at most
    ``timeout`` seconds. ``UNLOCK`` frees it (``lease`` and ``timeout`` unused)."""
    holder: int = 0
    lease: float = 0.0
    timeout: float = 0.0

    def args(self) -> tuple[int, int, float]:
        return self.holder, round(self.lease * 1000), self.timeout   # the lease travels in ms


@dataclass(slots=True)
class LockPiece(Request):
    """A ``LOCK``/``UNLOCK`` a primary applied and forwards: the word's new value and the
    answer the primary gave."""
    word: int = 0
    answer: int = 0

    def args(self) -> tuple[int, int, float]:
        return self.word, self.answer, 0.0


_NO_ROUND = ChunkRound(0, 1, 0)


@dataclass(slots=True)
class Push(Request):
    """A collective's push of a chunk (the payload) of ``dtype`` elements into the round
    ``ref`` names (:mod:`smb_protocol.rounds`): waits until the slot's previous round
    ended, stores or adds, counts the arrival."""
    dtype: int = 0
    ref: ChunkRound = _NO_ROUND
    timeout: float = 0.0
    payload: ClassVar[bool] = True

    @property
    def word(self) -> int:
        return self.ref.word

    def dtype_code(self) -> int:
        return self.dtype

    def args(self) -> tuple[int, int, float]:
        return (*self.ref.args(), self.timeout)


@dataclass(slots=True)
class Pull(Request):
    """A collective's pull of the round ``ref`` names: waits until every party's push is
    in, answers the chunk, counts the pull. ``dtype``: the chunk's types
    (:mod:`smb_protocol.chunk_types`; 0: the slot's bytes as they are)."""
    ref: ChunkRound = _NO_ROUND
    timeout: float = 0.0
    dtype: int = 0

    @property
    def word(self) -> int:
        return self.ref.word

    def args(self) -> tuple[int, int, float]:
        return (*self.ref.args(), self.timeout)

    def what(self) -> tuple[int, ...]:
        return (int(self.op), self.extent_id, self.offset, self.length, self.ref.word)

    def dtype_code(self) -> int:
        return self.dtype


@dataclass(slots=True)
class Reduce(Push):
    """A push whose sum the server streams back once every party pushed (``REDUCE``):
    the push as :class:`Push`, then :meth:`pull`."""

    def pull(self) -> Pull:
        """The pull that delivers the chunk's sum, numbered ``seq + 1``."""
        return Pull(Op.PULL, self.req_id, self.extent_id, self.offset, self.length, self.client,
                    self.seq + 1 if self.seq else 0, ref=self.ref, timeout=self.timeout, dtype=self.dtype)


@dataclass(slots=True)
class Seed(Request):
    """Exactly-once entries a primary hands a copy it filled (the payload). ``forget``:
    instead, the copy drops the entries it holds for the extent (a sync that replaces the
    copy's bytes begins: what an earlier primary forwarded to it is not this one's)."""
    forget: bool = False
    payload: ClassVar[bool] = True

    def args(self) -> tuple[int, int, float]:
        return int(self.forget), 0, 0.0


_ARITH = {Op.ACCUMULATE: Arith.ACCUMULATE, Op.AXPY: Arith.AXPY, Op.SCALE: Arith.SCALE}
_MSG_ARITH = {MsgOp.ACCUMULATE: Arith.ACCUMULATE, MsgOp.AXPY: Arith.AXPY, MsgOp.SCALE: Arith.SCALE}


def from_frame(op: Op, dtype: int, req_id: int, extent_id: int, offset: int, length: int,
               arg0: int, arg1: int, alpha: float, client: int, seq: int,
               forwarded: bool = False, trace: bytes | None = None) -> Request:
    """The request of a tcp frame header (see :mod:`smb_protocol.wire` for the fields);
    InvalidArgument for fields that cannot be the operation's. ``forwarded``: the
    connection presented a replica ticket for the extent, so a mutation is a piece a
    primary forwards. ``trace``: the traceparent that followed the header."""
    head = (op, req_id, extent_id, offset, length, client, seq, forwarded, trace)
    arith = _ARITH.get(op)
    if arith is not None:
        return Arithmetic(*head, arith=arith, dtype=dtype, alpha=alpha, whole=(arg0, arg1))
    if op is Op.WRITE:
        return Write(*head, whole=(arg0, arg1))
    if op is Op.READ:
        return Read(*head)
    if op is Op.FETCH_ADD:
        return FetchAdd(*head, value=arg0)
    if op is Op.COMPARE_SWAP:
        return CompareSwap(*head, expected=arg0, desired=arg1)
    if op is Op.WAIT:
        return Wait(*head, cond=dtype, value=arg0, timeout=alpha)
    if op in (Op.LOCK, Op.UNLOCK):
        if forwarded:
            return LockPiece(*head, word=arg0, answer=arg1)
        return Lock(*head, holder=arg0, lease=arg1 / 1000.0, timeout=alpha)
    if op is Op.PUSH:
        return Push(*head, dtype=dtype, ref=ChunkRound.from_args(arg0, arg1), timeout=alpha)
    if op is Op.PULL:
        return Pull(*head, ref=ChunkRound.from_args(arg0, arg1), timeout=alpha, dtype=dtype)
    if op is Op.REDUCE:
        return Reduce(*head, dtype=dtype, ref=ChunkRound.from_args(arg0, arg1), timeout=alpha)
    if op is Op.SEED:
        return Seed(*head, forget=bool(arg0))
    if op is Op.HELLO:
        return Hello(*head)
    return Ping(*head)


def from_message(op: int, dtype: int, req_id: int, extent_id: int, offset: int, length: int,
                 alpha: float, client: int, seq: int) -> Arithmetic | None:
    """The request of an rdma message (two-sided arithmetic); None for an unknown
    operation."""
    try:
        arith = _MSG_ARITH[MsgOp(op)]
    except (ValueError, KeyError):
        return None
    wire_op = {Arith.ACCUMULATE: Op.ACCUMULATE, Arith.AXPY: Op.AXPY, Arith.SCALE: Op.SCALE}[arith]
    return Arithmetic(wire_op, req_id, extent_id, offset, length, client, seq, False, arith=arith,
                      dtype=dtype, alpha=alpha)
