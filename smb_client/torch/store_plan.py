"""A parameter store's regions: planned, made and opened.

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

:func:`plan_store` sizes them for :meth:`ParameterStore.create
<smb_client.torch.store.ParameterStore.create>` (no client: a :class:`StorePlan`);
:func:`make_regions` and :func:`make_description` make what a plan says (the
description last, so that its presence means "ready"), and :func:`open_regions` opens
them again for :meth:`~smb_client.torch.store.ParameterStore.attach`.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from smb_protocol.errors import InvalidArgument, RegionExists, RegionNotFound
from smb_protocol.placement import PLACEMENTS

from . import failure
from .layout import ALIGN, FlatLayout, align_up

if TYPE_CHECKING:
    from ..client import Client
    from ..region import Region
    from .flat import FlatModel

log = logging.getLogger(__name__)

META_MAGIC = b"SMBPSTOR"
META_HEADER = struct.Struct("<8sQ")     # magic, JSON length (bytes)
META_PAGE = 4096                        # bytes; the meta region is a whole number of these
ATTACH_POLL = 0.05                      # seconds between looks for a store being created
COUNTER_WORDS = 8                       # int64 control words before the per-worker counts
KINDS = ("params", "grads", "deltas", "counters", "buffers", "allreduce", "meta")
SYNC_SLOTS = 3                          # gradient slots synchronous training rotates through
BUFFER_SLOTS = 1 + SYNC_SLOTS           # the published buffers, then one per rotated step
SCHEMES = ("sync", "seasgd", "hybrid")  # what ParameterStore.create sizes the slots for by default


def region_name(prefix: str, kind: str) -> str:
    """The name of the store's ``kind`` region under ``prefix``."""
    return f"{prefix}/{kind}"


@dataclass(frozen=True)
class RegionPlan:
    """One region to make: its ``kind``, ``name``, ``size`` (bytes) and the options of
    :meth:`Client.create_region <smb_client.Client.create_region>` it is made with."""

    kind: str
    name: str
    size: int
    options: dict[str, Any]


@dataclass(frozen=True)
class StorePlan:
    """What :meth:`ParameterStore.create <smb_client.torch.store.ParameterStore.create>`
    makes under ``prefix`` (the options are create's)."""

    prefix: str
    layout: FlatLayout
    buffer_layout: FlatLayout | None    # None: no buffers region
    placement: str
    grad_slots: int
    delta_slots: int
    workers: int
    stripe_unit: int | None             # bytes per stripe (striped); None or 0: see spread_over
    num_servers: int
    lease: float | None                 # seconds
    replicas: int
    attempt: int

    @property
    def needs_servers(self) -> bool:
        """A striped store without a stripe unit: :meth:`spread_over` the servers up."""
        return self.placement == "striped" and not self.stripe_unit

    def spread_over(self, up: int) -> StorePlan:
        """This plan with the stripe unit that spreads one slot over ``num_servers``
        servers (or the ``up`` servers that are up, at least one)."""
        return replace(self, stripe_unit=self.layout.stripe_unit(self.num_servers or max(1, up)))

    @property
    def meta(self) -> dict[str, Any]:
        """The store's description (stored as JSON in its ``meta`` region)."""
        blayout = self.buffer_layout
        meta = {"layout": json.loads(self.layout.to_json()), "placement": self.placement,
                "grad_slots": self.grad_slots, "delta_slots": self.delta_slots, "workers": self.workers,
                "buffers": json.loads(blayout.to_json()) if blayout is not None else None}
        if self.lease is not None:
            meta["lease"] = float(self.lease)
        if self.attempt:
            meta["attempt"] = int(self.attempt)
        return meta

    def description(self) -> bytes:
        """What the ``meta`` region holds: a header (magic, length), then :attr:`meta`."""
        doc = json.dumps(self.meta).encode()
        return META_HEADER.pack(META_MAGIC, len(doc)) + doc

    def _region(self, kind: str, size: int, **options: Any) -> RegionPlan:
        if self.replicas != 1:    # as before for clients that predate replicas
            options["replicas"] = self.replicas
        return RegionPlan(kind, region_name(self.prefix, kind), size, options)

    def _slots(self, kind: str, slots: int) -> RegionPlan:
        size = self.layout.slot_bytes * slots
        if self.placement == "layered":
            return self._region(kind, size, placement="layered", segment_sizes=self.layout.segment_sizes(slots))
        if self.placement == "striped":
            return self._region(kind, size, placement="striped", stripe_unit=self.stripe_unit or 0,
                                num_servers=self.num_servers)
        return self._region(kind, size, placement="single")

    @property
    def regions(self) -> list[RegionPlan]:
        """The regions before the description, in the order they are made."""
        out = [self._slots("params", 1)]
        if self.grad_slots:
            out.append(self._slots("grads", self.grad_slots))
        if self.delta_slots:
            out.append(self._slots("deltas", self.delta_slots))
        # the per-worker counts, then as many attendance words (the last ones: sync.py)
        out.append(self._region("counters", align_up((COUNTER_WORDS + 2 * self.workers) * 8, ALIGN),
                                placement="single"))
        if self.buffer_layout is not None:
            out.append(self._region("buffers", self.buffer_layout.slot_bytes * BUFFER_SLOTS, placement="single"))
        return out

    def description_region(self, nbytes: int) -> RegionPlan:
        """The ``meta`` region for a description of ``nbytes`` bytes."""
        return self._region("meta", align_up(nbytes, META_PAGE), placement="single")


def check_options(placement: str, scheme: str | None, workers: int) -> None:
    """InvalidArgument for an unknown ``placement`` or ``scheme``, or no ``workers``."""
    if placement not in PLACEMENTS:
        raise InvalidArgument(f"unknown placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if scheme is not None and scheme not in SCHEMES:
        raise InvalidArgument(f"unknown scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if workers < 1:
        raise InvalidArgument(f"workers must be >= 1, got {workers}")


def plan_store(prefix: str, flat: FlatModel, *, scheme: str | None, placement: str, grad_slots: int | None,
               delta_slots: int | None, workers: int, buffers: bool, stripe_unit: int | None, num_servers: int,
               lease: float | None, replicas: int, attempt: int) -> StorePlan:
    """The plan of a store for the model ``flat`` binds, with the slot counts that are
    not given sized by ``scheme`` (see :meth:`ParameterStore.create
    <smb_client.torch.store.ParameterStore.create>`, whose options these are).
    InvalidArgument (or DtypeError, for a buffer) where they cannot apply. Talks to
    nobody: a striped store's default stripe unit is :meth:`StorePlan.spread_over`'s."""
    check_options(placement, scheme, workers)
    if scheme is None and grad_slots is None and delta_slots is None:
        scheme = "sync"
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
    return StorePlan(prefix, layout, blayout, placement, grad_slots, delta_slots, workers, stripe_unit,
                     num_servers, lease, replicas, attempt)


def check_free(client: Client, prefix: str) -> None:
    """RegionExists when any region of a store is under ``prefix``."""
    names = {region_name(prefix, kind) for kind in KINDS}
    found = sorted(r.name for r in client.list_regions(f"{prefix}/") if r.name in names)
    if found:
        raise RegionExists(f"parameter store {prefix!r} already exists ({', '.join(found)}); pass "
                           "replace=True to delete it and create a new one, or attach to it")


def make_regions(client: Client, plan: StorePlan, into: dict[str, Region]) -> None:
    """Make the regions of ``plan`` (all but the description), each into ``into`` (by
    kind) as soon as it exists, so that a failed creation can :func:`discard` them."""
    for r in plan.regions:
        into[r.kind] = client.create_region(r.name, r.size, lease=plan.lease, **r.options)


def make_description(client: Client, plan: StorePlan, into: dict[str, Region]) -> None:
    """Make the ``meta`` region into ``into`` and write the plan's description in it:
    the last step of a creation (its presence means the store is ready)."""
    blob = plan.description()
    r = plan.description_region(len(blob))
    into[r.kind] = client.create_region(r.name, r.size, lease=plan.lease, **r.options)
    into[r.kind].write(0, blob)


def discard(client: Client, regions: dict[str, Region]) -> None:
    """Close and delete ``regions`` (only what a failed creation made: never another
    store's)."""
    for r in regions.values():
        r.close()
        try:
            client.delete_region(r.name)
        except RegionNotFound:
            pass


def wait_description(client: Client, prefix: str, timeout: float) -> Region:
    """The ``meta`` region under ``prefix``, waiting up to ``timeout`` seconds for it to
    appear (a failure the master recorded meanwhile is raised: :func:`failure.check
    <smb_client.torch.failure.check>`)."""
    deadline = time.monotonic() + timeout
    since = time.time()
    name = region_name(prefix, "meta")
    while True:
        try:
            return client.open_region(name)
        except RegionNotFound:
            failure.check(client, prefix, since)
            if time.monotonic() > deadline:
                raise RegionNotFound(f"no parameter store {prefix!r} after {timeout:g} s: "
                                     f"the master creates {name} (ParameterStore.create)") from None
            time.sleep(ATTACH_POLL)


def read_description(region: Any) -> dict[str, Any]:
    """The description a ``meta`` region holds (InvalidArgument if it holds none)."""
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


def open_regions(client: Client, prefix: str, flat: FlatModel, regions: dict[str, Region]) -> dict[str, Any]:
    """Read the description in ``regions["meta"]``, check ``flat``'s model against it
    (InvalidArgument or DtypeError on a mismatch) and open the regions it names into
    ``regions``; returns the description."""
    meta = read_description(regions["meta"])
    stored = FlatLayout.from_json(json.dumps(meta["layout"]))
    stored.check_same(flat.layout, where=f"parameter store {prefix!r}")
    kinds = ["params", "counters"] + [k for k, n in (("grads", meta["grad_slots"]),
                                                     ("deltas", meta["delta_slots"])) if n]
    if meta.get("buffers"):
        kinds.append("buffers")
        stored_b = FlatLayout.from_json(json.dumps(meta["buffers"]), allow_empty=True)
        stored_b.check_same(FlatLayout.of_buffers(flat.model), where=f"parameter store {prefix!r} (buffers)")
    for kind in kinds:
        regions[kind] = client.open_region(region_name(prefix, kind))
    counts = {"params": 1, "grads": meta["grad_slots"], "deltas": meta["delta_slots"]}
    for kind, slots in counts.items():
        if kind in regions and regions[kind].size != slots * stored.slot_bytes:
            raise InvalidArgument(f"region {regions[kind].name} holds {regions[kind].size} bytes, "
                                  f"the layout needs {slots * stored.slot_bytes}")
    return meta
