"""The memory a collective's chunk moves through over RDMA (:mod:`.reduce`): the caller's
buffers registered zero-copy and cached by their owner, or a registered bounce ring the
pieces are copied through, and the ring allocator the stream also uses for the server's
staging area."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from smb_protocol.errors import InvalidArgument
from smb_protocol.rdma.endpoint import RegisteredBuffer
from smb_protocol.rdma_wire import MAX_DESTINATIONS

from ..errors import ConnectionBroken
from ..stream import Reduction
from .registration import RegistrationCache, address_of, owner_of

BOUNCE_BYTES = 16 << 20     # a stream's registered bounce ring, bytes (made when first needed)
IDLE_WAIT = 0.05            # seconds between checks while waiting for bounce room


class Ring:
    """First-fit space in a buffer of ``size`` bytes for ranges that are freed in any
    order (nearly first in, first out): the next range goes after the last one taken,
    or at 0."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._head = 0
        self._live: dict[int, tuple[int, int]] = {}
        self._ids = itertools.count(1)

    def take(self, n: int) -> tuple[int, int] | None:
        """(token, offset) of ``n`` free bytes, or None while there is no room."""
        if n > self.size:
            raise InvalidArgument(f"{n} bytes do not fit a {self.size}-byte ring")
        if not self._live:
            self._head = 0
        for start in (self._head, 0):
            end = start + n
            if end <= self.size and all(e <= start or end <= s for s, e in self._live.values()):
                token = next(self._ids)
                self._live[token] = (start, end)
                self._head = end
                return token, start
        return None

    def free(self, token: int) -> None:
        self._live.pop(token, None)


class InFlight:
    """One reduction in flight: its ranges in the staging and bounce rings, the caller
    buffers it holds registered, and the bounced pieces its sum is copied into."""

    __slots__ = ("r", "staging", "bounce", "held", "copy_out", "pushed")

    def __init__(self, r: Reduction) -> None:
        self.r = r
        self.staging = 0
        self.bounce = 0
        self.held: list[Any] = []
        self.copy_out: list[tuple[int, memoryview]] = []
        self.pushed = False



class ChunkBuffers:
    """The local side of a stream's reductions: registrations from ``cache`` (the
    server may write into them; borrowed) and the bounce ring (owned). ``cond``: the
    stream's condition, held while ring space changes; ``broken()``: whether a wait for
    bounce room should give up (called with ``cond`` held)."""

    def __init__(self, cache: RegistrationCache, cond: threading.Condition, broken: Callable[[], bool]) -> None:
        self.cache = cache
        self.cond = cond
        self.broken = broken
        self._bounce: RegisteredBuffer | None = None
        self._ring = Ring(BOUNCE_BYTES)

    def registered(self, sent: InFlight, b: memoryview) -> Any:
        """A cached registration of ``b``'s owner when it outlives a round, else None."""
        owned = owner_of(b)
        if owned is None or owned[2] - owned[1] < 2 * len(b):   # a buffer of its own: made per round
            return None
        reg = self.cache.acquire(owned[0], owned[1], owned[2], True)
        if reg is not None:
            sent.held.append(reg)
        return reg

    def bounce_range(self, sent: InFlight, n: int) -> int:
        """Offset of ``n`` bytes of the bounce ring held by ``sent`` (waits for room)."""
        if self._bounce is None:
            import pyverbs.enums as e
            self._bounce = RegisteredBuffer(self.cache.device, BOUNCE_BYTES,  # type: ignore[arg-type]  # a verbs.Device here
                                            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        with self.cond:
            while True:
                got = self._ring.take(n)
                if got is not None:
                    break
                if self.broken():
                    raise ConnectionBroken("the queue pair broke")
                self.cond.wait(IDLE_WAIT)
        if sent.bounce:
            raise AssertionError("one bounce range per reduction")
        sent.bounce, at = got
        return at

    def local(self, sent: InFlight, parts: Sequence[memoryview]) -> list[tuple[int, int, int]]:
        """(address, lkey, bytes) of each piece to push."""
        out: list[tuple[int, int, int]] = []
        bounced: list[memoryview] = []
        for b in parts:
            if not len(b):
                continue
            reg = self.registered(sent, b) if len(parts) <= MAX_DESTINATIONS else None
            if reg is not None:
                out.append((address_of(b), int(reg.mr.lkey), len(b)))
            else:
                bounced.append(b)
        if bounced:
            n = sum(len(b) for b in bounced)
            at = self.bounce_range(sent, n + sent.r.answer_nbytes)
            assert self._bounce is not None
            pos = at
            for b in bounced:
                self._bounce.view[pos:pos + len(b)] = b
                pos += len(b)
            out.append((self._bounce.address + at, self._bounce.lkey, n))
            sent.copy_out.append((at + n, memoryview(b"")))   # where the sum may land (see _remote)
        return out

    def remote(self, sent: InFlight, into: Sequence[memoryview]) -> tuple[tuple[int, int, int], ...]:
        """(address, rkey, bytes) of each buffer the sum goes to, in order."""
        pieces = [b for b in into if len(b)]
        regs = [self.registered(sent, b) for b in pieces] if len(pieces) <= MAX_DESTINATIONS else []
        if pieces and len(regs) == len(pieces) and all(reg is not None for reg in regs):
            return tuple((address_of(b), int(reg.mr.rkey), len(b)) for b, reg in zip(pieces, regs, strict=True))
        # the sum lands in the bounce ring and is copied out once it is in
        if sent.copy_out:
            at = sent.copy_out.pop()[0]
        else:
            at = self.bounce_range(sent, sent.r.answer_nbytes)
        assert self._bounce is not None
        pos = at
        for b in pieces:
            sent.copy_out.append((pos, b))
            pos += len(b)
        return ((self._bounce.address + at, self._bounce.rkey, sent.r.answer_nbytes),)

    def copy_out(self, sent: InFlight) -> None:
        """The sum is in: copy its bounced pieces into the caller's buffers."""
        for at, b in sent.copy_out:
            if len(b):
                assert self._bounce is not None
                b[:] = self._bounce.view[at:at + len(b)]

    def release(self, sent: InFlight) -> None:
        """Free ``sent``'s bounce range (``cond`` held)."""
        if sent.bounce:
            self._ring.free(sent.bounce)
            sent.bounce = 0

    def unhold(self, sent: InFlight) -> None:
        """Release the registrations ``sent`` held."""
        for reg in sent.held:
            self.cache.release(reg)
        sent.held = []

    def close(self) -> None:
        bounce, self._bounce = self._bounce, None
        if bounce is not None:
            bounce.close()
