"""The parameter store: a model's flat parameters, gradient and delta slots in regions.

The regions under a prefix (``job/params``, ``job/grads``, ...) are listed, sized and
made in :mod:`.store_plan`.

Every tensor is stored in its own element type (float32, bfloat16 or float16 for
parameters, so a slot's gradients are accumulated in the parameter's type).

What does not share :class:`ParameterStore`'s region handles and traffic count (the
failure record, checkpoint (de)serialization) lives in :mod:`.failure` and
:mod:`.checkpoint`.

The master creates them (:meth:`ParameterStore.create`, ``meta`` last, so that its
presence means "ready"); the others attach by name (:meth:`ParameterStore.attach`),
which checks their model against the stored layout. Creating over an existing store
raises :class:`~smb_protocol.errors.RegionExists` unless ``replace=True``.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from smb_protocol.errors import InvalidArgument, RegionNotFound

from . import checkpoint, failure, store_plan
from .flat import FlatModel
from .layout import FlatLayout
from .store_plan import COUNTER_WORDS as COUNTER_WORDS  # the constants, where callers have always found them
from .store_plan import SCHEMES as SCHEMES
from .store_plan import SYNC_SLOTS as SYNC_SLOTS

if TYPE_CHECKING:
    from ..client import Client
    from ..region import Region
    from .checkpoint import PathLike

#: what a store's regions move: a tensor (on the CPU) or a bytes-like buffer
Data = torch.Tensor | bytes | bytearray | memoryview

log = logging.getLogger(__name__)

ZERO_CHUNK = 8 << 20                    # bytes written per request when zeroing


@dataclass
class Traffic:
    """Bytes moved by this process through the store (payload only)."""

    sent: int = 0        # bytes written or accumulated into regions
    received: int = 0    # bytes read from regions
    ops: int = 0         # region operations issued

    def as_dict(self) -> dict[str, int]:
        """Sent and received bytes and operations, as a dict."""
        return {"sent": self.sent, "received": self.received, "ops": self.ops}


def _nbytes(data: Data) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


def _raw(data: Any) -> Any:
    """Byte tensors (a mixed-type flat buffer) travel as numpy bytes; typed ones (and CUDA
    ones, staged as bytes) as is."""
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and not data.is_cuda:
        return data.numpy()
    return data


class ParameterStore:
    """Owns its region handles and closes them in :meth:`close`; the :class:`Client`
    and the model are the caller's. ``flat`` binds the model's parameters and gradients
    to local flat buffers that region operations use in place."""

    publish_failure = staticmethod(failure.publish)   # see smb_client.torch.failure
    check_failure = staticmethod(failure.check)

    def __init__(self, client: Client, prefix: str, flat: FlatModel, regions: dict[str, Region],
                 meta: dict[str, Any], *, master: bool) -> None:
        self.client = client
        self.prefix = prefix
        self.flat = flat
        self.layout = flat.layout
        self.regions = regions
        self.grad_slots: int = meta["grad_slots"]
        self.delta_slots: int = meta["delta_slots"]
        self.workers: int = meta["workers"]
        self.placement: str = meta["placement"]
        #: seconds of the owner lease the regions were made with (None: none); regions
        #: made for the store later (the collective of SyncDataParallel) take it too
        self.lease: float | None = meta.get("lease")
        self.attempt: int = meta.get("attempt", 0)   # the restart count of the group that made it
        self.master = master
        self.traffic = Traffic()
        self._traffic_lock = threading.Lock()
        self.buffer_layout = FlatLayout.from_json(json.dumps(meta["buffers"]), allow_empty=True) \
            if meta.get("buffers") else None
        self.buffers: list[torch.Tensor] = [b for _, b in flat.model.named_buffers()] \
            if self.buffer_layout is not None else []

    # -- construction -------------------------------------------------------------
    region_name = staticmethod(store_plan.region_name)   # the name of the store's kind region under a prefix

    @classmethod
    def create(cls, client: Client, prefix: str, model: torch.nn.Module | FlatModel, *, scheme: str | None = None,
               placement: str = "striped", grad_slots: int | None = None, delta_slots: int | None = None,
               workers: int = 1, stripe_unit: int | None = None, num_servers: int = 0,
               replace: bool = False, buffers: bool = True, lease: float | None = None,
               replicas: int = 1, attempt: int = 0) -> ParameterStore:
        """Lay ``model`` out in new regions under ``prefix`` and store its parameters.

        ``scheme`` sizes the slots that are not given: ``sync`` (the default when
        neither count is given) the gradient slots :class:`SyncDataParallel`'s default
        exchange uses, so none is reserved unused: 0 when every parameter has one element
        type (the collective exchange sums gradients without slots), 3 when the model
        mixes types (``exchange="slots"``), and no delta slots; ``seasgd`` and ``hybrid``
        one delta slot per worker (``workers``) and no gradient slots. A count that is
        given wins (``grad_slots=3`` for ``exchange="slots"`` on a one-type model); when
        only one is given, the other is 0.

        ``placement``: ``striped`` ("memory-based sharding": every slot spread over the
        servers; ``stripe_unit`` bytes, by default one slot divided by the number of
        servers) or ``layered`` ("layer-based sharding": each tensor whole on one
        server) or ``single``. ``workers`` sizes the counter region.

        ``buffers``: keep the model's buffers (batch-norm statistics) in a ``buffers``
        region (when it has any), for :class:`SyncDataParallel` to synchronize and for
        checkpoints.

        A store (any of its regions) already under ``prefix`` raises RegionExists;
        ``replace=True`` deletes it first.

        ``lease`` (seconds): the regions belong to ``client``, which keeps them while it
        lives (see :meth:`Client.create_region`); once it is gone (killed, cut off or
        closed) for ``lease`` seconds, the controller deletes them. None: they stay until
        :meth:`destroy`.

        ``replicas`` (1 to 3): copies of every byte of every region, each on another
        memory server (see :meth:`Client.create_region`): training goes on when a server
        holding one dies, and the controller makes a new copy elsewhere.

        ``attempt``: the torchrun restart count of the group creating it, kept in the
        store's description (:attr:`attempt`), so that a later attempt can tell it
        resumes an earlier one's store.
        """
        store_plan.check_options(placement, scheme, workers)   # before the model is bound
        flat = model if isinstance(model, FlatModel) else FlatModel(model)
        plan = store_plan.plan_store(prefix, flat, scheme=scheme, placement=placement, grad_slots=grad_slots,
                                     delta_slots=delta_slots, workers=workers, buffers=buffers,
                                     stripe_unit=stripe_unit, num_servers=num_servers, lease=lease,
                                     replicas=replicas, attempt=attempt)
        failure.clear(client, prefix)
        if replace:
            cls.destroy_prefix(client, prefix)
        else:
            store_plan.check_free(client, prefix)
        if plan.needs_servers:
            plan = plan.spread_over(sum(1 for s in client.list_servers() if s.state == "up"))
        regions: dict[str, Region] = {}
        try:
            store_plan.make_regions(client, plan, regions)
            store = cls(client, prefix, flat, regions, plan.meta, master=True)
            store.push_params()
            for kind in ("grads", "deltas", "counters", "buffers"):
                if kind in regions:
                    store.zero(kind)
            if plan.buffer_layout is not None:
                store.push_buffers()
            store_plan.make_description(client, plan, regions)
        except BaseException:
            store_plan.discard(client, regions)
            raise
        log.info("created parameter store %s: %d tensors, %d bytes per slot, %s", prefix,
                 len(flat.layout.tensors), flat.layout.slot_bytes, placement)
        return store

    @classmethod
    def attach(cls, client: Client, prefix: str, model: torch.nn.Module | FlatModel, *, timeout: float = 60.0,
               pull: bool = True) -> ParameterStore:
        """Open the store the master created under ``prefix`` (waiting up to ``timeout``
        seconds for it to appear), check ``model`` against its layout (InvalidArgument
        or DtypeError on a mismatch) and, with ``pull``, load the stored parameters."""
        flat = model if isinstance(model, FlatModel) else FlatModel(model)
        regions = {"meta": store_plan.wait_description(client, prefix, timeout)}
        try:
            meta = store_plan.open_regions(client, prefix, flat, regions)
        except BaseException:
            for r in regions.values():
                r.close()
            raise
        store = cls(client, prefix, flat, regions, meta, master=False)
        if pull:
            store.pull_params()
            store.pull_buffers()
        return store

    @classmethod
    def destroy_prefix(cls, client: Client, prefix: str) -> None:
        """Delete every store region under ``prefix`` that exists (meta first)."""
        for kind in reversed(store_plan.KINDS + (failure.KIND,)):
            try:
                client.delete_region(cls.region_name(prefix, kind))
            except RegionNotFound:
                pass

    # -- lifecycle ----------------------------------------------------------------
    def __enter__(self) -> ParameterStore:
        """The store itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close` (the regions stay: :meth:`destroy` deletes them)."""
        self.close()

    def close(self) -> None:
        """Close the region handles (the regions stay)."""
        for r in self.regions.values():
            r.close()

    def destroy(self) -> None:
        """Close the handles and delete the regions (usually the master, at the end)."""
        self.close()
        self.destroy_prefix(self.client, self.prefix)

    # -- traffic-counted operations -----------------------------------------------
    def region(self, kind: str) -> Region:
        """The store's ``kind`` region (InvalidArgument when it has none)."""
        try:
            return self.regions[kind]
        except KeyError:
            raise InvalidArgument(f"parameter store {self.prefix!r} has no {kind} region "
                                  f"(create it with {kind.rstrip('s')}_slots=...)") from None

    def count_traffic(self, sent: int = 0, received: int = 0) -> None:
        """Add one operation of ``sent`` and ``received`` bytes to :attr:`traffic`
        (the exchanges of :mod:`.sync` count theirs here too)."""
        with self._traffic_lock:
            self.traffic.sent += sent
            self.traffic.received += received
            self.traffic.ops += 1

    def slot_offset(self, kind: str, slot: int) -> int:
        """Byte offset of ``slot`` in the ``kind`` region."""
        slots = {"params": 1, "grads": self.grad_slots, "deltas": self.delta_slots}[kind]
        if not 0 <= slot < slots:
            raise InvalidArgument(f"{kind} slot {slot} out of range: the store has {slots}")
        return slot * self.layout.slot_bytes

    def read_into(self, kind: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Read ``kind``'s bytes at ``offset`` into ``out`` (counted); returns ``out``."""
        self.region(kind).read_into(offset, _raw(out))
        self.count_traffic(received=_nbytes(out))
        return out

    def write(self, kind: str, offset: int, data: Data) -> None:
        """Write ``data`` at byte ``offset`` of ``kind`` (counted)."""
        self.region(kind).write(offset, _raw(data))
        self.count_traffic(sent=_nbytes(data))

    def accumulate(self, kind: str, offset: int, data: torch.Tensor) -> None:
        """Add ``data`` at byte ``offset`` of ``kind``, server-side (counted)."""
        self.region(kind).accumulate(offset, data)
        self.count_traffic(sent=_nbytes(data))

    def accumulate_async(self, kind: str, offset: int, data: torch.Tensor) -> Future[Any]:
        """A future of :meth:`accumulate`."""
        fut: Future[Any] = self.region(kind).accumulate_async(offset, data)
        self.count_traffic(sent=_nbytes(data))
        return fut

    def write_async(self, kind: str, offset: int, data: Data) -> Future[Any]:
        """A future of :meth:`write`."""
        fut: Future[Any] = self.region(kind).write_async(offset, _raw(data))
        self.count_traffic(sent=_nbytes(data))
        return fut

    def accumulate_flat(self, kind: str, base: int, flat: torch.Tensor, offset: int = 0,
                        length: int | None = None) -> list[Future[Any]]:
        """Accumulate bytes ``[offset, offset+length)`` of a flat buffer of the layout
        into the ``kind`` region at ``base + offset``, asynchronously: one operation per
        run of one element type."""
        n = self.layout.slot_bytes - offset if length is None else length
        return [self.accumulate_async(kind, base + off, view) for off, view in self.flat.typed(flat, offset, n)]

    def zero(self, kind: str, offset: int = 0, length: int | None = None) -> None:
        """Write zeros over ``[offset, offset+length)`` bytes of the ``kind`` region."""
        region = self.region(kind)
        end = region.size if length is None else offset + length
        zeros = bytes(min(ZERO_CHUNK, max(0, end - offset)))
        pos = offset
        while pos < end:
            n = min(len(zeros), end - pos)
            region.write(pos, memoryview(zeros)[:n])
            self.count_traffic(sent=n)
            pos += n

    # -- whole-model moves --------------------------------------------------------
    def pull_params(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """Read the stored parameters into the model (or into the flat tensor ``into``,
        shaped like ``flat.flat_params``)."""
        ref = self.flat.flat_params
        out = ref if into is None else into
        if out.numel() != ref.numel() or out.dtype != ref.dtype or not out.is_contiguous():
            raise InvalidArgument(f"need a contiguous {str(ref.dtype).removeprefix('torch.')} tensor of "
                                  f"{ref.numel()} elements")
        return self.read_into("params", 0, out)

    def push_params(self) -> None:
        """Write the model's parameters into the params region."""
        self.write("params", 0, self.flat.flat_params)

    # -- buffers ------------------------------------------------------------------
    def buffer_offset(self, slot: int) -> int:
        """Byte offset of buffer ``slot`` (0: the published copy; 1..3: synchronous steps)."""
        if self.buffer_layout is None:
            raise InvalidArgument(f"parameter store {self.prefix!r} holds no buffers (the model has none, "
                                  "or it was created with buffers=False)")
        if not 0 <= slot < store_plan.BUFFER_SLOTS:
            raise InvalidArgument(f"buffer slot {slot} out of range: the store has {store_plan.BUFFER_SLOTS}")
        return slot * self.buffer_layout.slot_bytes

    def buffer_items(self, slot: int, tensors: list[torch.Tensor] | None = None,
                     floating_only: bool = False) -> list[tuple[int, torch.Tensor]]:
        """(region offset, tensor) of each non-empty model buffer of buffer ``slot`` (of
        ``tensors`` instead of the model's when given; floating ones only if asked)."""
        assert self.buffer_layout is not None
        base = self.buffer_offset(slot)
        src = self.buffers if tensors is None else tensors
        return [(base + t.offset, b) for t, b in zip(self.buffer_layout.tensors, src, strict=True)
                if b.numel() and (not floating_only or b.is_floating_point())]

    def push_buffers(self, slot: int = 0) -> None:
        """Write the model's buffers into buffer ``slot`` (nothing without buffers)."""
        if self.buffer_layout is None:
            return
        items = [(off, b.detach().contiguous()) for off, b in self.buffer_items(slot)]
        self.region("buffers").write_many(items)
        self.count_traffic(sent=sum(_nbytes(b) for _, b in items))

    def pull_buffers(self, slot: int = 0, into: list[torch.Tensor] | None = None) -> None:
        """Read buffer ``slot`` into the model's buffers (or into ``into``, in the
        order of ``named_buffers()``), in place."""
        if self.buffer_layout is None:
            return
        items = self.buffer_items(slot, into)
        with torch.no_grad():
            self.region("buffers").read_many(items)
        self.count_traffic(received=sum(_nbytes(b) for _, b in items))

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the stored parameters (and buffers, if the store holds them) into another
        model of the same architecture (e.g. an evaluation copy), without binding it."""
        other = FlatLayout.of_module(model)
        self.layout.check_same(other, where=f"parameter store {self.prefix!r}")
        state = self.state_dict()
        model.load_state_dict(state, strict=self.buffer_layout is not None)

    # -- checkpoints (smb_client.torch.checkpoint) ------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stored parameters and published buffers, named as ``model.state_dict()``."""
        return checkpoint.state_dict(self)

    def save(self, path: PathLike, optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> None:
        """``torch.save`` the :meth:`state_dict` to ``path``; with ``optimizer`` (or
        ``extra`` values, such as ``step=``) a dict ``{"model": ..., "optimizer": ...,
        **extra}`` instead (:func:`~smb_client.torch.checkpoint.save`)."""
        checkpoint.save(self.state_dict(), path, optimizer, **extra)

    def load(self, path: PathLike, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """A checkpoint (a state dict, or what :meth:`save` wrote with an optimizer) into
        the store and the bound model, its optimizer state into ``optimizer`` when both
        are there; returns the checkpoint's extra values (``{}`` for a plain state dict)."""
        return checkpoint.load(self, path, optimizer)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A state dict into the store and the bound model (see :meth:`load`)."""
        checkpoint.load_state_dict(self, state)

    def tensor_servers(self, kind: str = "params", slot: int = 0) -> dict[str, list[str]]:
        """The memory server(s) holding each tensor of ``slot``: tensor name -> server ids."""
        region = self.region(kind)
        base = self.slot_offset(kind, slot)
        out = {}
        for t in self.layout.tensors:
            pieces = region.layout.map(base + t.offset, t.padded)
            out[t.name] = sorted({region.extents[p.extent].server_id for p in pieces})
        return out
