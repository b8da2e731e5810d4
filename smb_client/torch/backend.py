"""A ``torch.distributed`` backend, ``"smb"``, whose collectives run through the memory box.

    import smb_client.torch          # registers the backend (or: backend.register())
    torch.distributed.init_process_group("smb")     # under torchrun; then plain DDP

Rank, world size and the c10d store come from ``init_process_group``, the memory box
from ``SMB_CONTROLLER`` and ``SMB_TOKEN`` (:func:`smb_client.connect`). CPU and CUDA
tensors (a CUDA tensor is staged through pinned host memory, :mod:`smb_client.cuda`, so
DDP on a CUDA model runs unchanged).

Every operation is a :class:`~smb_client.collective.Collective` round, made lazily per
*size class* (a power of two, at least :data:`MIN_CLASS` bytes): rank 0 creates
``torch/<id>/c<bytes>`` and says so in the c10d store, the others open it once the key
is there (every rank runs the same operations in the same order). Operations run in
order on one worker thread; each call returns an :class:`SMBWork` whose ``wait()`` and
``get_future()`` give the result or raise the error (a dead server, a timeout). After a
failed operation the process group refuses the next ones. A callback chained on an
operation's future (``fut.then(fn)``: DDP's communication hooks, PowerSGD's chain of
all-reduces) is queued behind the operations the caller started before it and runs on
the worker thread, whether the operation already ended or not; an operation it starts
runs there at once. So every rank runs the same operations in the same order, however
its threads are timed (a callback run at once in whichever thread chained it, as
plain futures do, would start its all-reduce at a moment that differs between ranks).

* ``allreduce`` (also coalesced): ``SUM`` on float32, float16, bfloat16, float64, int32
  and int64; ``AVG`` on the floating-point ones (sum, then divide). Any other
  operation raises :class:`UnsupportedOperation` at the call, naming what is supported.
* ``broadcast``, ``allgather`` (and ``all_gather_into_tensor``), ``reduce_scatter``
  (and ``reduce_scatter_tensor``), ``barrier``. Broadcast and all-gather move bytes, so
  they take any dtype: all-gather sums a buffer in which each rank filled only its own
  part (as 64-bit integers, which adds exactly), so it costs ``world`` times the data.
  The others (reduce, gather, scatter, all-to-all, send, recv) raise UnsupportedOperation.

An operation that waits longer than :data:`~smb_client.coord.REPORT_EVERY` seconds for
the other ranks logs how many arrived, and one that times out raises
:class:`~smb_client.coord.PartiesMissing` naming the ranks that did not come (ranks say
how far they came in the c10d store, ``smb/<attempt>/at/<rank>``, once one of their waits stalls).
``SMBWork.wait(timeout)`` raises :class:`~smb_protocol.errors.Timeout` once ``timeout``
passed (the operation goes on).

``destroy_process_group()`` closes the collectives; rank 0 deletes their regions once
every rank closed (or after the group's timeout, at most :data:`SHUTDOWN_WAIT`). A
program that ends without it leaves nothing behind either: the regions hold an owner
lease of :data:`LEASE` seconds on rank 0's client, so the controller deletes them once
that process is gone.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ProcessGroup,
    ReduceOp,
    ReduceScatterOptions,
    Store,
)
from torch.distributed.distributed_c10d import GroupName

from smb_protocol.errors import InvalidArgument, SMBError

from ..client import Client, connect
from ..collective import Collective
from .supported import REDUCIBLE, UnsupportedOperation, check_device, check_reduce
from .work import OperationWorker, SMBWork, StoreRoll

log = logging.getLogger(__name__)

__all__ = ["BACKEND", "MIN_CLASS", "SMBProcessGroup", "SMBWork", "UnsupportedOperation", "register"]

BACKEND = "smb"
MIN_CLASS = 64 << 10          # bytes: the smallest collective
SHUTDOWN_WAIT = 300.0         # seconds rank 0 waits, at most, for the others to close
POLL = 0.05                   # seconds between looks at the store while shutting down
LEASE = 60.0                  # seconds the collectives' regions outlive rank 0's process
_registered = False


def register() -> None:
    """Register the ``smb`` backend with ``torch.distributed`` (once; ``import
    smb_client.torch`` calls it)."""
    global _registered
    if _registered or not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True


def _create(opts: Any, _backend_options: Any) -> SMBProcessGroup:
    return SMBProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def size_class(nbytes: int) -> int:
    """The collective size that holds ``nbytes``: a power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, flat (uint8)."""
    return t.reshape(-1).view(torch.uint8)


class SMBProcessGroup(ProcessGroup):
    """The ``smb`` process group of ``size`` ranks (made by ``init_process_group``).
    Owns its client (:func:`smb_client.connect`), its worker thread and its
    collectives; ``store`` (the group's c10d store) is borrowed. ``timeout``: how
    long a collective waits for the other ranks. ``attempt``: which start of the job
    this is (default ``$TORCHELASTIC_RESTART_COUNT``, which torchrun sets, else 0): its
    keys in the store are its own (``smb/<attempt>/...``), so a group restarted on the
    store of a dead attempt (torchrun keeps its store across restarts) never reads that
    attempt's prefix or collectives; the dead attempt's regions go with their lease."""

    def __init__(self, store: Store, rank: int, size: int, timeout: datetime.timedelta,
                 client: Client | None = None, attempt: int | None = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python-subclass form
        self._rank, self._size = rank, size
        self._store = store
        self._timeout = timeout
        self._seconds = max(1.0, timeout.total_seconds())
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._keys = f"smb/{attempt}"
        if rank == 0:
            self.prefix = f"torch/{uuid.uuid4().hex[:16]}"
        else:
            store.wait([f"{self._keys}/prefix"], timeout)
        self.client = client if client is not None else connect()
        if rank == 0:
            store.set(f"{self._keys}/prefix", self.prefix)
        else:
            self.prefix = store.get(f"{self._keys}/prefix").decode()
        self.collectives: dict[int, Collective] = {}
        self._ops = OperationWorker(self.prefix)   # the worker thread and the failure state
        self.roll = StoreRoll(store, rank, size, self._keys)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """``"smb"``."""
        return BACKEND

    @property
    def group_name(self) -> GroupName:
        """The name torch registered the group under (``destroy_process_group(group)``
        asks; a Python process group has no backend to keep it)."""
        return dist.distributed_c10d._world.pg_names.get(self, GroupName(self.prefix))

    def on_worker(self) -> bool:
        """Whether the calling thread is the worker running an operation or callback."""
        return self._ops.on_worker()

    def collective(self, nbytes: int) -> Collective:
        """The collective of ``nbytes``' size class, made (rank 0) or opened (the
        others, once the store says it exists) on first use; on the worker thread."""
        cls = size_class(nbytes)
        coll = self.collectives.get(cls)
        if coll is not None:
            return coll
        name, key = f"{self.prefix}/c{cls}", f"{self._keys}/c{cls}"
        if self._rank == 0:
            try:
                coll = Collective.create(self.client, name, cls, self._size, timeout=self._seconds,
                                         lease=LEASE)
            except BaseException as exc:
                self._store.set(key, f"error: {exc!r}")
                raise
            self._store.set(key, "ok")
        else:
            self._store.wait([key], self._timeout)
            said = self._store.get(key).decode()
            if said != "ok":
                raise InvalidArgument(f"rank 0 could not create collective {name}: {said}")
            coll = Collective.open(self.client, name, self._size, timeout=self._seconds, fresh=True)
        coll.roll = self.roll
        self.collectives[cls] = coll
        return coll

    def _sum(self, buf: torch.Tensor, wire: str | None = None, full_sum: bool = False) -> None:
        """Sum the contiguous ``buf`` over the ranks, in place (worker thread); ``wire``,
        ``full_sum``: as for :meth:`Collective.all_reduce`."""
        if buf.numel():
            self.collective(buf.numel() * buf.element_size()).all_reduce(buf, wire=wire, full_sum=full_sum)

    def _reduce(self, t: torch.Tensor, average: bool) -> None:
        buf = t if t.is_contiguous() else t.contiguous()
        self._sum(buf)
        if average:
            buf.div_(self._size)
        if buf is not t:
            t.copy_(buf)

    # -- collectives ----------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions | None = None) -> SMBWork:  # type: ignore[override]
        """Reduce each tensor over the ranks in place (SUM or AVG)."""
        average = check_reduce(opts.reduceOp if opts is not None else ReduceOp.SUM, tensors)

        def run() -> list[torch.Tensor]:
            for t in tensors:
                self._reduce(t, average)
            return tensors
        return self._ops.submit(run, "all_reduce", tensors)

    allreduce_coalesced = allreduce

    def allreduce_wire(self, tensors: list[torch.Tensor], wire: str, full_sum: bool = False) -> SMBWork:
        """Sum float32 ``tensors`` over the ranks in place, sent as 16-bit ``wire`` values
        (``"bf16"`` or ``"fp16"``) and summed in float32 on the memory servers; the sum
        comes back rounded once to ``wire``, or as float32 with ``full_sum``
        (:meth:`~smb_client.collective.Collective.all_reduce`). Every rank passes the same."""
        check_reduce(ReduceOp.SUM, tensors)

        def run() -> list[torch.Tensor]:
            for t in tensors:
                buf = t if t.is_contiguous() else t.contiguous()
                self._sum(buf, wire, full_sum)
                if buf is not t:
                    t.copy_(buf)
            return tensors
        return self._ops.submit(run, "all_reduce", tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions | None = None) -> SMBWork:  # type: ignore[override]
        """Give every rank the root rank's tensors (any dtype)."""
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            check_device(t)

        def run() -> list[torch.Tensor]:
            for t in tensors:
                if not t.numel():
                    continue
                buf = t if t.is_contiguous() else t.contiguous()
                raw = _bytes(buf)
                if buf.dtype in REDUCIBLE:
                    self.collective(raw.numel()).broadcast(buf, root, self._rank)
                else:   # as 64-bit words
                    words = torch.zeros(-(-raw.numel() // 8), dtype=torch.int64)
                    words.view(torch.uint8)[:raw.numel()].copy_(raw)
                    self.collective(words.numel() * 8).broadcast(words, root, self._rank)
                    raw.copy_(words.view(torch.uint8)[:raw.numel()])
                if buf is not t:
                    t.copy_(buf)
            return tensors
        return self._ops.submit(run, "broadcast", tensors)

    def _gather(self, outputs: list[torch.Tensor], inp: torch.Tensor) -> None:
        """Every rank's ``inp`` into ``outputs[r]`` (worker thread)."""
        src = _bytes(inp.contiguous())
        n = src.numel()
        step = -(-n // 8) * 8        # each rank's part, in whole 64-bit words
        words = torch.zeros(self._size * step // 8, dtype=torch.int64)
        raw = words.view(torch.uint8)
        raw[self._rank * step:self._rank * step + n].copy_(src)
        self._sum(words)
        for r, out in enumerate(outputs):
            out.copy_(raw[r * step:r * step + n].view(inp.dtype).reshape(out.shape))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: AllgatherOptions | None = None) -> SMBWork:
        """``output_tensors[i][r]`` becomes rank r's ``input_tensors[i]`` (any dtype)."""
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            check_device(inp)
            if len(outs) != self._size:
                raise InvalidArgument(f"allgather needs {self._size} output tensors, got {len(outs)}")

        def run() -> list[list[torch.Tensor]]:
            for outs, inp in zip(output_tensors, input_tensors, strict=True):
                self._gather(outs, inp)
            return output_tensors
        return self._ops.submit(run, "all_gather", [*input_tensors, *(t for outs in output_tensors for t in outs)])

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> SMBWork:
        """``output`` (``size`` times ``inp``'s elements) becomes every rank's ``inp`` in
        rank order."""
        check_device(inp)
        if output.numel() != inp.numel() * self._size:
            raise InvalidArgument(f"all_gather_into_tensor: output holds {output.numel()} elements, "
                                  f"not {self._size} x {inp.numel()}")

        def run() -> list[torch.Tensor]:
            flat = output.view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
            self._gather(list(flat.chunk(self._size)) if inp.numel() else [], inp)
            if flat.data_ptr() != output.data_ptr():
                output.copy_(flat.view(output.shape))
            return [output]
        return self._ops.submit(run, "all_gather_into_tensor", [inp, output])

    _allgather_base = all_gather_single  # type: ignore[assignment]  # the older name

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: ReduceScatterOptions | None = None) -> SMBWork:
        """``output_tensors[i]`` becomes the reduction of every rank's
        ``input_tensors[i][rank]`` (SUM or AVG)."""
        average = check_reduce(opts.reduceOp if opts is not None else ReduceOp.SUM,
                                [t for ins in input_tensors for t in ins])

        def run() -> list[torch.Tensor]:
            for out, ins in zip(output_tensors, input_tensors, strict=True):
                stage = torch.cat([t.reshape(-1) for t in ins])
                self._reduce(stage, average)
                lo = sum(t.numel() for t in ins[:self._rank])
                out.copy_(stage[lo:lo + ins[self._rank].numel()].view(out.shape))
            return output_tensors
        return self._ops.submit(run, "reduce_scatter", [*output_tensors, *(t for ins in input_tensors for t in ins)])

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor,
                             opts: ReduceScatterOptions | None = None) -> SMBWork:
        """``output`` becomes this rank's ``1/size`` share of the reduced ``inp``."""
        average = check_reduce(opts.reduceOp if opts is not None else ReduceOp.SUM, [inp, output])
        if inp.numel() != output.numel() * self._size:
            raise InvalidArgument(f"reduce_scatter_tensor: input holds {inp.numel()} elements, "
                                  f"not {self._size} x {output.numel()}")

        def run() -> list[torch.Tensor]:
            stage = inp.reshape(-1).clone()
            self._reduce(stage, average)
            n = output.numel()
            output.copy_(stage[self._rank * n:(self._rank + 1) * n].view(output.shape))
            return [output]
        return self._ops.submit(run, "reduce_scatter_tensor", [inp, output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # the older name

    def barrier(self, opts: BarrierOptions | None = None) -> SMBWork:  # type: ignore[override]
        """Done once every rank called it (after every earlier operation)."""
        def run() -> list[torch.Tensor]:
            self._sum(torch.zeros(1, dtype=torch.int64))
            return []
        return self._ops.submit(run, "barrier")

    # -- the end --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish the queued operations, close the collectives and the client; rank 0
        deletes the collectives' regions once every rank closed (``destroy_process_group``
        calls it)."""
        if not self._ops.close():
            return
        for coll in self.collectives.values():
            coll.close()
        try:
            self._store.add(f"{self._keys}/closed", 1)
            if self._rank == 0:
                self._wait_closed()
                for coll in self.collectives.values():
                    self.client.delete_region(coll.region.name)
        except (SMBError, RuntimeError) as exc:
            log.warning("smb process group %s: cleanup failed: %r", self.prefix, exc)
        finally:
            self.client.close()

    def _wait_closed(self) -> None:
        deadline = time.monotonic() + min(self._seconds, SHUTDOWN_WAIT)
        while (closed := self._store.add(f"{self._keys}/closed", 0)) < self._size:
            if time.monotonic() > deadline:
                log.warning("smb process group %s: %d of %d ranks closed; deleting its regions anyway",
                            self.prefix, closed, self._size)
                return
            time.sleep(POLL)


def _unsupported(name: str) -> Callable[..., SMBWork]:
    def op(self: SMBProcessGroup, *args: Any, **kwargs: Any) -> SMBWork:
        raise UnsupportedOperation(f"the smb backend has no {name}: it does all_reduce, broadcast, "
                                   "all_gather, reduce_scatter and barrier")
    return op


for _name in ("reduce", "gather", "scatter", "alltoall", "all_to_all_single", "send", "recv", "recv_anysource"):
    setattr(SMBProcessGroup, _name, _unsupported(_name))
