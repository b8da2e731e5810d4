"""CUDA tensors through the memory box: staged through pinned host buffers.

The data plane moves host memory (sockets, shared memory, RDMA registrations of host
pages), so an operation on a CUDA tensor is *staged*: its bytes are copied between the
device and page-locked (pinned) host buffers on a CUDA stream of the memory box's own,
in chunks of :data:`STAGE_CHUNK` bytes, while the network moves the neighbouring chunk:

* pushes (``write``, ``accumulate``, ``axpy``): the device-to-host copy of chunk
  ``i+1`` runs while chunk ``i`` is sent;
* pulls (``read_into``): the host-to-device copy of chunk ``i`` runs while chunk
  ``i+1`` arrives;
* an all-reduce copies each collective chunk to the host as its bytes become final and
  pushes it as soon as its copy is done; each chunk's sum goes back to the device as it
  arrives, while later sums are still on their way.

The caller's CUDA stream is respected with events: staging starts after the work
queued on the caller's current stream (so it sees the values the caller's kernels
produce), and the caller's stream waits for the copies back before its next kernel runs.
Nothing calls ``torch.cuda.synchronize()``; the host waits only for the copies of the
chunk it is about to send. The bytes moved are the ones the CPU path moves, so results
are bit-identical to it.

Pinned buffers come from a small pool per device (:class:`Stager`), reused across
operations; a buffer goes back to the pool with the event of its last copy, and the next
user waits for that event. Torch is imported only when a CUDA tensor is in hand:
``import smb_client`` does not need it.

Region operations on CUDA tensors are in :mod:`.cuda_region`, collective rounds in
:mod:`.cuda_round`. GPUDirect RDMA (a NIC
reading device memory) is not used: see docs/rdma.md.

Region handles are typed ``Any`` here: this module sits below :mod:`.region`, which
calls it.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from smb_protocol.errors import InvalidArgument

log = logging.getLogger(__name__)

__all__ = ["HostLane", "Lane", "STAGE_CHUNK", "Stager", "is_cuda", "stager_for"]

STAGE_CHUNK = 8 << 20      # bytes per pinned staging buffer (a multiple of every element size)
POOL_BUFFERS = 4           # staging buffers in flight per operation (and kept per device)
KEEP_MIRRORS = 4           # idle whole-tensor host copies kept per device, for collectives
ROUND_THREADS = 4          # collective rounds a device can be finishing at once

T = TypeVar("T")


def is_cuda(data: object) -> bool:
    """Whether ``data`` is a torch tensor in CUDA memory (torch is not imported)."""
    return type(data).__module__.startswith("torch") and getattr(data, "is_cuda", False) is True


def _flat_bytes(t: Any) -> Any:
    """The bytes of the contiguous tensor ``t`` (a flat uint8 view)."""
    import torch
    return t.detach().reshape(-1).view(torch.uint8)


def _host_view(buf: Any, dtype: Any) -> Any:
    """The pinned byte tensor ``buf`` as the buffer a region operation takes: a tensor
    of ``dtype``, or numpy bytes for untyped (uint8) data, as the CPU path sends them."""
    import torch
    if dtype == torch.uint8:
        return buf.numpy()
    return buf.view(dtype)


# -- where the copies run ------------------------------------------------------------
class Lane:
    """Copies between one CUDA device and pinned host memory, on a stream of the memory
    box's own. Events order it against the caller's stream."""

    def __init__(self, device: Any) -> None:
        import torch
        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def caller(self) -> Any:
        """The caller's current stream on this device (thread-local)."""
        return self.torch.cuda.current_stream(self.device)

    def after(self, stream: Any) -> None:
        """Copies queued from now on start after the work queued on ``stream`` so far."""
        self.stream.wait_stream(stream)

    def release_to(self, stream: Any) -> None:
        """``stream`` waits for every copy queued so far before its next work."""
        stream.wait_stream(self.stream)

    def copy(self, dst: Any, src: Any) -> Any:
        """Queue ``dst.copy_(src)`` on the box's stream; the event of its end."""
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        event = self.torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def host_wait(self, event: Any) -> None:
        """Block this thread until ``event`` happened (None: nothing to wait for)."""
        if event is not None:
            event.synchronize()

    def keep(self, t: Any) -> None:
        """Keep ``t``'s device memory from reuse until the box's copies of it ran."""
        t.record_stream(self.stream)

    def pinned(self, nbytes: int) -> Any:
        """A page-locked host byte tensor of ``nbytes``."""
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)


class HostLane(Lane):
    """A :class:`Lane` whose "device" is host memory and whose copies run at once: the
    staging pipeline's logic, run where no CUDA device exists (the tests use it)."""

    def __init__(self) -> None:
        import torch
        self.torch = torch
        self.device = torch.device("cpu")
        self.copies = 0          # copies made, either way

    def caller(self) -> Any:
        return None

    def after(self, stream: Any) -> None:
        pass

    def release_to(self, stream: Any) -> None:
        pass

    def copy(self, dst: Any, src: Any) -> Any:
        dst.copy_(src)
        self.copies += 1
        return None

    def keep(self, t: Any) -> None:
        pass

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)


# -- the pool and the pipelines --------------------------------------------------------
class Stager:
    """The staging of one device: its :class:`Lane`, a pool of pinned chunk buffers, a
    few whole-tensor host copies for collectives, and the threads of collective rounds.
    One per device (:func:`stager_for`), shared by every region and collective of the
    process; thread-safe."""

    def __init__(self, lane: Lane, chunk: int = STAGE_CHUNK, buffers: int = POOL_BUFFERS) -> None:
        if chunk < 8 or chunk % 8:
            raise InvalidArgument(f"staging chunk must be a positive multiple of 8 bytes, not {chunk}")
        self.lane = lane
        self.chunk = chunk
        self.buffers = max(2, buffers)
        self._lock = threading.Lock()
        self._free: list[tuple[Any, Any]] = []                 # (pinned chunk, event of its last copy)
        self._mirrors: dict[int, list[tuple[Any, Any]]] = {}   # nbytes -> idle host copies
        self._feeder: ThreadPoolExecutor | None = None         # pushes chunks once their copies ended
        self._rounds: ThreadPoolExecutor | None = None         # waits out rounds (reports, errors)

    # buffers ------------------------------------------------------------------------
    def take(self) -> Any:
        """A pinned chunk buffer whose earlier copies have ended."""
        with self._lock:
            got = self._free.pop() if self._free else None
        if got is None:
            return self.lane.pinned(self.chunk)
        buf, event = got
        self.lane.host_wait(event)
        return buf

    def give(self, buf: Any, event: Any = None) -> None:
        """Return a chunk buffer; ``event``: the end of a copy still running on it."""
        with self._lock:
            if len(self._free) < self.buffers:
                self._free.append((buf, event))

    def mirror(self, nbytes: int) -> Any:
        """A pinned host byte tensor of ``nbytes`` (reused, its copies ended)."""
        with self._lock:
            idle = self._mirrors.get(nbytes)
            got = idle.pop() if idle else None
        if got is None:
            return self.lane.pinned(nbytes)
        buf, event = got
        self.lane.host_wait(event)
        return buf

    def unmirror(self, buf: Any, event: Any = None) -> None:
        """Return a host copy from :meth:`mirror`."""
        with self._lock:
            idle = self._mirrors.setdefault(buf.numel(), [])
            if len(idle) < KEEP_MIRRORS:
                idle.append((buf, event))

    def feeder(self) -> ThreadPoolExecutor:
        """The one thread that hands staged chunks to collective rounds, in order."""
        with self._lock:
            if self._feeder is None:
                self._feeder = ThreadPoolExecutor(1, thread_name_prefix="smb-stage")
            return self._feeder

    def rounds(self) -> ThreadPoolExecutor:
        """Threads that wait for collective rounds to end."""
        with self._lock:
            if self._rounds is None:
                self._rounds = ThreadPoolExecutor(ROUND_THREADS, thread_name_prefix="smb-stage-round")
            return self._rounds

    def spans(self, nbytes: int) -> list[tuple[int, int]]:
        """``[start, end)`` byte ranges of the chunks of ``nbytes``."""
        return [(a, min(nbytes, a + self.chunk)) for a in range(0, nbytes, self.chunk)]

    # pipelines -----------------------------------------------------------------------
    def push(self, src: Any, send: Callable[[int, Any], None]) -> None:
        """Send the contiguous device tensor ``src`` chunk by chunk: ``send(offset,
        host)`` for each chunk in order (``offset`` in bytes, ``host`` a pinned buffer
        of ``src``'s type), the device-to-host copies of later chunks running meanwhile."""
        lane = self.lane
        raw = _flat_bytes(src)
        spans = self.spans(raw.numel())
        lane.after(lane.caller())
        free = [self.take() for _ in range(min(len(spans), self.buffers))]
        staged: deque[tuple[Any, Any]] = deque()
        nxt = 0
        try:
            for a, b in spans:
                while free and nxt < len(spans):
                    x, y = spans[nxt]
                    buf = free.pop()
                    staged.append((buf, lane.copy(buf[:y - x], raw[x:y])))
                    nxt += 1
                buf, event = staged.popleft()
                lane.host_wait(event)
                free.append(buf)
                send(a, _host_view(buf[:b - a], src.dtype))
        finally:
            for buf, event in staged:
                self.give(buf, event)
            for buf in free:
                self.give(buf)

    def pull(self, dst: Any, fetch: Callable[[int, Any], None]) -> None:
        """Fill the contiguous device tensor ``dst`` chunk by chunk: ``fetch(offset,
        host)`` fills a pinned buffer, whose host-to-device copy runs while the next
        chunk is fetched. The caller's stream waits for the copies."""
        lane = self.lane
        raw = _flat_bytes(dst)
        caller = lane.caller()
        lane.after(caller)            # the caller's kernels still using dst come first
        copying: deque[tuple[Any, Any]] = deque()
        try:
            for a, b in self.spans(raw.numel()):
                if len(copying) < self.buffers:
                    buf = self.take()
                else:
                    buf, event = copying.popleft()
                    lane.host_wait(event)
                fetch(a, _host_view(buf[:b - a], dst.dtype))
                copying.append((buf, lane.copy(raw[a:b], buf[:b - a])))
        finally:
            lane.release_to(caller)
            lane.keep(dst)
            for buf, event in copying:
                self.give(buf, event)

    def to_host(self, src: Any) -> tuple[Any, Any]:
        """A pinned host copy of the device tensor ``src`` (whole) and its byte mirror
        (give it back with :meth:`unmirror`); the copy has ended."""
        raw = _flat_bytes(src)
        mirror = self.mirror(raw.numel())
        self.lane.after(self.lane.caller())
        event = None
        for a, b in self.spans(raw.numel()):
            event = self.lane.copy(mirror[a:b], raw[a:b])
        self.lane.host_wait(event)
        return _host_view(mirror, src.dtype), mirror

    def to_device(self, mirror: Any, dst: Any) -> None:
        """Copy the host bytes ``mirror`` into the device tensor ``dst`` (the caller's
        stream waits for it) and return ``mirror`` to the pool."""
        raw = _flat_bytes(dst)
        caller = self.lane.caller()
        self.lane.after(caller)
        event = None
        for a, b in self.spans(raw.numel()):
            event = self.lane.copy(raw[a:b], mirror[a:b])
        self.lane.release_to(caller)
        self.lane.keep(dst)
        self.unmirror(mirror, event)


_stagers: dict[Any, Stager] = {}
_stagers_lock = threading.Lock()


def stager_for(t: Any) -> Stager:
    """The :class:`Stager` of the device ``t`` (a CUDA tensor) lives on."""
    device = t.device
    with _stagers_lock:
        got = _stagers.get(device)
        if got is None:
            got = _stagers[device] = Stager(Lane(device))
            log.debug("staging CUDA tensors of %s through pinned host buffers", device)
        return got


def _contiguous(t: Any, writable: bool) -> Any:
    if t.is_contiguous():
        return t
    if writable:
        raise InvalidArgument("read_into needs a contiguous tensor")
    return t.contiguous()


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())
