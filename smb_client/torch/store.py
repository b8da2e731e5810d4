"""The parameter store: a model's flat parameters, gradient and delta slots in regions.

Regions under a prefix ``job``:

==================  ==========================================================
``job/meta``        the layout (tensor names and shapes) and slot counts, JSON
``job/params``      one slot: the parameters (the global weights for SEASGD)
``job/grads``       ``grad_slots`` slots: gradient accumulation (synchronous training
                    with ``exchange="slots"``; the collective exchange needs none)
``job/deltas``      ``delta_slots`` slots: one private delta buffer per worker
``job/counters``    int64 words: stop word, total and per-worker iteration counts
``job/buffers``     the model's buffers (batch-norm statistics), 4 slots: slot 0
                    the published copy, slots 1-3 rotated by synchronous steps
``job/failed``      only after a failed creation: the master's error, JSON
==================  ==========================================================

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
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from smb_protocol.errors import InvalidArgument, RegionExists, RegionNotFound
from smb_protocol.placement import PLACEMENTS

from . import checkpoint, failure
from .flat import FlatModel
from .layout import ALIGN, FlatLayout, align_up

if TYPE_CHECKING:
    from ..client import Client
    from ..region import Region
    from .checkpoint import PathLike

#: what a store's regions move: a tensor (on the CPU) or a bytes-like buffer
Data = torch.Tensor | bytes | bytearray | memoryview

log = logging.getLogger(__name__)

META_MAGIC = b"SMBPSTOR"
META_HEADER = struct.Struct("<8sQ")     # magic, JSON length (bytes)
META_PAGE = 4096                        # bytes; the meta region is a whole number of these
ZERO_CHUNK = 8 << 20                    # bytes written per request when zeroing
ATTACH_POLL = 0.05                      # seconds between looks for a store being created
COUNTER_WORDS = 8                       # int64 control words before the per-worker counts
KINDS = ("params", "grads", "deltas", "counters", "buffers", "allreduce", "meta")
SYNC_SLOTS = 3                          # gradient slots synchronous training rotates through
BUFFER_SLOTS = 1 + SYNC_SLOTS           # the published buffers, then one per rotated step
SCHEMES = ("sync", "seasgd", "hybrid")  # what ParameterStore.create sizes the slots for by default


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
    @staticmethod
    def region_name(prefix: str, kind: str) -> str:
        """The name of the store's ``kind`` region under ``prefix``."""
        return f"{prefix}/{kind}"

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
        if placement not in PLACEMENTS:
            raise InvalidArgument(f"unknown placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if scheme is not None and scheme not in SCHEMES:
            raise InvalidArgument(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
        if workers < 1:
            raise InvalidArgument(f"workers must be >= 1, got {workers}")
        if scheme is None and grad_slots is None and delta_slots is None:
            scheme = "sync"
        flat = model if isinstance(model, FlatModel) else FlatModel(model)
        layout = flat.layout
        if grad_slots is None:   # the slots exchange (mixed types) rotates SYNC_SLOTS of them
            grad_slots = SYNC_SLOTS if scheme == "sync" and layout.uniform is None else 0
        if delta_slots is None:
            delta_slots = workers if scheme in ("seasgd", "hybrid") else 0
        if grad_slots < 0 or delta_slots < 0:
            raise InvalidArgument("grad_slots and delta_slots must be >= 0")
        blayout = FlatLayout.of_buffers(flat.model) if buffers else None
        if blayout is not None and not blayout.tensors:
            blayout = None
        failure.clear(client, prefix)
        if replace:
            cls.destroy_prefix(client, prefix)
        else:
            cls._check_free(client, prefix)
        if placement == "striped" and not stripe_unit:
            up = [s for s in client.list_servers() if s.state == "up"]
            stripe_unit = layout.stripe_unit(num_servers or max(1, len(up)))
        meta = {"layout": json.loads(layout.to_json()), "placement": placement,
                "grad_slots": grad_slots, "delta_slots": delta_slots, "workers": workers,
                "buffers": json.loads(blayout.to_json()) if blayout is not None else None}
        if lease is not None:
            meta["lease"] = float(lease)
        if attempt:
            meta["attempt"] = int(attempt)
        regions: dict[str, Region] = {}

        def create_region(name: str, size: int, **options: Any) -> Region:
            if replicas != 1:    # as before for clients that predate replicas
                options["replicas"] = replicas
            return client.create_region(name, size, lease=lease, **options)
        try:
            def make(kind: str, slots: int) -> None:
                size = layout.slot_bytes * slots
                name = cls.region_name(prefix, kind)
                if placement == "layered":
                    regions[kind] = create_region(name, size, placement="layered",
                                                         segment_sizes=layout.segment_sizes(slots))
                elif placement == "striped":
                    regions[kind] = create_region(name, size, placement="striped",
                                                         stripe_unit=stripe_unit or 0,
                                                         num_servers=num_servers)
                else:
                    regions[kind] = create_region(name, size, placement="single")
            make("params", 1)
            if grad_slots:
                make("grads", grad_slots)
            if delta_slots:
                make("deltas", delta_slots)
            # the per-worker counts, then as many attendance words (the last ones: sync.py)
            counters = align_up((COUNTER_WORDS + 2 * workers) * 8, ALIGN)
            regions["counters"] = create_region(cls.region_name(prefix, "counters"), counters,
                                                       placement="single")
            if blayout is not None:
                regions["buffers"] = create_region(cls.region_name(prefix, "buffers"),
                                                          blayout.slot_bytes * BUFFER_SLOTS, placement="single")
            store = cls(client, prefix, flat, regions, meta, master=True)
            store.push_params()
            for kind in ("grads", "deltas", "counters", "buffers"):
                if kind in regions:
                    store.zero(kind)
            if blayout is not None:
                store.push_buffers()
            doc = json.dumps(meta).encode()
            blob = META_HEADER.pack(META_MAGIC, len(doc)) + doc
            regions["meta"] = create_region(
                cls.region_name(prefix, "meta"), align_up(len(blob), META_PAGE), placement="single")
            regions["meta"].write(0, blob)
        except BaseException:
            for r in regions.values():   # only what this call created: never another store's
                r.close()
                try:
                    client.delete_region(r.name)
                except RegionNotFound:
                    pass
            raise
        log.info("created parameter store %s: %d tensors, %d bytes per slot, %s", prefix,
                 len(layout.tensors), layout.slot_bytes, placement)
        return store

    @classmethod
    def _check_free(cls, client: Any, prefix: str) -> None:
        names = {cls.region_name(prefix, kind) for kind in KINDS}
        found = sorted(r.name for r in client.list_regions(f"{prefix}/") if r.name in names)
        if found:
            raise RegionExists(f"parameter store {prefix!r} already exists ({', '.join(found)}); pass "
                               "replace=True to delete it and create a new one, or attach to it")

    @classmethod
    def attach(cls, client: Client, prefix: str, model: torch.nn.Module | FlatModel, *, timeout: float = 60.0,
               pull: bool = True) -> ParameterStore:
        """Open the store the master created under ``prefix`` (waiting up to ``timeout``
        seconds for it to appear), check ``model`` against its layout (InvalidArgument
        or DtypeError on a mismatch) and, with ``pull``, load the stored parameters."""
        flat = model if isinstance(model, FlatModel) else FlatModel(model)
        deadline = time.monotonic() + timeout
        since = time.time()
        name = cls.region_name(prefix, "meta")
        while True:
            try:
                meta_region = client.open_region(name)
                break
            except RegionNotFound:
                failure.check(client, prefix, since)
                if time.monotonic() > deadline:
                    raise RegionNotFound(f"no parameter store {prefix!r} after {timeout:g} s: "
                                         f"the master creates {name} (ParameterStore.create)") from None
                time.sleep(ATTACH_POLL)
        regions = {"meta": meta_region}
        try:
            meta = cls._read_meta(meta_region)
            stored = FlatLayout.from_json(json.dumps(meta["layout"]))
            stored.check_same(flat.layout, where=f"parameter store {prefix!r}")
            kinds = ["params", "counters"] + [k for k, n in (("grads", meta["grad_slots"]),
                                                             ("deltas", meta["delta_slots"])) if n]
            if meta.get("buffers"):
                kinds.append("buffers")
                stored_b = FlatLayout.from_json(json.dumps(meta["buffers"]), allow_empty=True)
                stored_b.check_same(FlatLayout.of_buffers(flat.model), where=f"parameter store {prefix!r} (buffers)")
            for kind in kinds:
                regions[kind] = client.open_region(cls.region_name(prefix, kind))
            counts = {"params": 1, "grads": meta["grad_slots"], "deltas": meta["delta_slots"]}
            for kind, slots in counts.items():
                if kind in regions and regions[kind].size != slots * stored.slot_bytes:
                    raise InvalidArgument(f"region {regions[kind].name} holds {regions[kind].size} bytes, "
                                          f"the layout needs {slots * stored.slot_bytes}")
        except BaseException:
            for r in regions.values():
                r.close()
            raise
        store = cls(client, prefix, flat, regions, meta, master=False)
        if pull:
            store.pull_params()
            store.pull_buffers()
        return store

    @staticmethod
    def _read_meta(region: Any) -> dict[str, Any]:
        head = bytes(region.read(0, META_HEADER.size))
        magic, length = META_HEADER.unpack(head)
        if magic != META_MAGIC or length > region.size - META_HEADER.size:
            raise InvalidArgument(f"region {region.name} is not a parameter-store description")
        try:
            doc = json.loads(bytes(region.read(META_HEADER.size, length)))
            assert isinstance(doc, dict)
            return doc
        except ValueError as exc:
            raise InvalidArgument(f"region {region.name}: unreadable description: {exc}") from None

    @classmethod
    def destroy_prefix(cls, client: Client, prefix: str) -> None:
        """Delete every store region under ``prefix`` that exists (meta first)."""
        for kind in reversed(KINDS + (failure.KIND,)):
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
        if not 0 <= slot < BUFFER_SLOTS:
            raise InvalidArgument(f"buffer slot {slot} out of range: the store has {BUFFER_SLOTS}")
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
