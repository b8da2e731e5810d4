"""A model whose parameters and gradients are views into two flat tensors.

:class:`FlatModel` re-points every parameter's ``.data`` (and ``.grad``) at a slice of
one contiguous buffer laid out by :class:`~smb_client.torch.layout.FlatLayout`, so a
whole model moves with one region operation and no staging copy: the client library
reads into and writes from these buffers in place.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from smb_protocol.errors import InvalidArgument

from .layout import Bucket, FlatLayout

log = logging.getLogger(__name__)


class FlatModel:
    """Binds ``model``'s parameters to flat buffers (keeping their current values).

    The model keeps its ``Parameter`` objects (optimizers built before or after see the
    same ones); only their storage moves. Buffers such as batch-norm statistics are not
    part of the flat layout.

    ``flat_params`` and ``flat_grads`` are of the parameters' element type (float32,
    bfloat16 or float16); a model that mixes types gets ``uint8`` byte buffers instead,
    each tensor at its byte offset in its own type (:meth:`typed` cuts byte ranges into
    typed views).

    Frozen parameters (``requires_grad=False`` when the model is bound) keep their
    place in the layout but get no gradient view: their ``.grad`` stays None, so an
    optimizer leaves them alone, and :meth:`runs` and :meth:`buckets` skip them.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layout = FlatLayout.of_module(model)
        self.params: list[torch.nn.Parameter] = [p for _, p in model.named_parameters()]
        self.trainable: list[bool] = [bool(p.requires_grad) for p in self.params]
        n = self.layout.slot_bytes
        #: where the flat buffers live: the parameters' device (a CUDA one's region
        #: operations are staged through pinned host memory, see smb_client.cuda)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.param_bytes = torch.zeros(n, dtype=torch.uint8, device=self.device)
        self.grad_bytes = torch.zeros(n, dtype=torch.uint8, device=self.device)
        uniform = self.layout.uniform
        self.dtype = torch_dtype(uniform) if uniform else None   # None: mixed types
        self.flat_params = self.param_bytes if self.dtype is None else self.param_bytes.view(self.dtype)
        self.flat_grads = self.grad_bytes if self.dtype is None else self.grad_bytes.view(self.dtype)
        self.param_views: list[torch.Tensor] = []
        self.grad_views: list[torch.Tensor] = []
        with torch.no_grad():
            for p, t in zip(self.params, self.layout.tensors, strict=True):
                dt = torch_dtype(t.dtype)
                pv = self.param_bytes[t.offset:t.offset + t.nbytes].view(dt).view(t.shape)
                gv = self.grad_bytes[t.offset:t.offset + t.nbytes].view(dt).view(t.shape)
                pv.copy_(p.detach())
                p.data = pv
                if p.requires_grad:
                    p.grad = gv
                self.param_views.append(pv)
                self.grad_views.append(gv)

    @property
    def nbytes(self) -> int:
        """Bytes of one flat copy (padding included)."""
        return self.layout.slot_bytes

    def zero_grad(self) -> None:
        """Zero the flat gradient buffer and point every trainable ``.grad`` back at it."""
        self.flat_grads.zero_()
        for p, gv, trainable in zip(self.params, self.grad_views, self.trainable, strict=True):
            if trainable:
                p.grad = gv

    def check_trainable(self) -> None:
        """Raise InvalidArgument if a parameter was frozen or unfrozen after binding."""
        for (name, p), trainable in zip(self.model.named_parameters(), self.trainable, strict=True):
            if bool(p.requires_grad) != trainable:
                raise InvalidArgument(f"parameter {name!r} changed requires_grad after the model was bound; "
                                      "build the FlatModel (store) and the training scheme again")

    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """Consecutive trainable tensors grouped into buckets of about ``bucket_bytes``,
        from the last tensor to the first; a frozen tensor ends a bucket, so no bucket
        covers one."""
        if bucket_bytes <= 0:
            raise InvalidArgument(f"bucket size must be positive, got {bucket_bytes}")
        tensors = self.layout.tensors
        out: list[Bucket] = []
        last = -1
        size = 0

        def close(first: int) -> None:
            start = tensors[first].offset
            end = tensors[last].offset + tensors[last].padded
            out.append(Bucket(first, last, start, end - start))

        for i in range(len(tensors) - 1, -1, -1):
            if not self.trainable[i]:
                if last >= 0:
                    close(i + 1)
                last, size = -1, 0
                continue
            if last < 0:
                last = i
            size += tensors[i].padded
            if size >= bucket_bytes or i == 0:
                close(i)
                last, size = -1, 0
        return out

    def runs(self) -> list[tuple[int, int]]:
        """``(offset, length)`` byte ranges of a slot that hold trainable tensors
        (maximal, in increasing order): what gradient traffic has to cover."""
        return sorted((b.offset, b.length) for b in self.buckets(1 << 62))

    def collect_grad(self, i: int) -> None:
        """Make sure parameter ``i``'s gradient lives in its flat view (copy it in when
        something, e.g. ``optimizer.zero_grad(set_to_none=True)``, replaced it)."""
        if not self.trainable[i]:
            return
        p, gv = self.params[i], self.grad_views[i]
        g = p.grad
        if g is None:
            gv.zero_()
        elif g.data_ptr() != gv.data_ptr():
            gv.copy_(g)
        else:
            return
        p.grad = gv

    def collect_grads(self) -> None:
        """Copy gradients that autograd left outside the flat buffer into it."""
        for i in range(len(self.params)):
            self.collect_grad(i)

    def check_bound(self) -> None:
        """Raise InvalidArgument if a parameter no longer lives in the flat buffer
        (e.g. the model was moved with ``.to()`` after binding)."""
        for (name, p), pv in zip(self.model.named_parameters(), self.param_views, strict=True):
            if p.data_ptr() != pv.data_ptr():
                raise InvalidArgument(f"parameter {name!r} was moved out of the flat buffer "
                                      "(by .to(), .cuda() or load_state_dict with assign=True); bind again")

    def byte_range(self, flat: torch.Tensor, offset: int, length: int) -> torch.Tensor:
        """The elements of ``flat`` covering bytes ``[offset, offset+length)`` (a view)."""
        size = flat.element_size()
        return flat[offset // size:(offset + length) // size]

    def typed(self, flat: torch.Tensor, offset: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """Bytes ``[offset, offset+length)`` of a flat buffer of this layout as
        ``(offset, view)`` pieces, each view of one element type (one piece unless the
        model mixes types)."""
        raw = flat.view(torch.uint8)
        return [(off, raw[off:off + n].view(torch_dtype(dt)))
                for off, n, dt in self.layout.typed_runs(offset, length)]

    def scale_(self, flat: torch.Tensor, alpha: float) -> None:
        """``flat *= alpha`` for a flat buffer of this layout, each tensor in its type."""
        if self.dtype is not None:
            flat.mul_(alpha)
            return
        for _, view in self.typed(flat, 0, self.layout.slot_bytes):
            view.mul_(alpha)

    def new_flat(self) -> torch.Tensor:
        """A zeroed flat buffer shaped like ``flat_params``."""
        return torch.zeros_like(self.flat_params)


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass ends (from inside a hook)."""
    engine = cast(Any, torch.autograd.Variable)._execution_engine
    engine.queue_callback(fn)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype)
    return dt


class GradientHooks:
    """Calls ``launch(bucket)`` as soon as every gradient of a bucket is final during a
    backward pass (``register_post_accumulate_grad_hook``), always in bucket order, so
    that communication of late layers overlaps the backward pass of early ones. Frozen
    parameters get no hook and belong to no bucket.

    While :attr:`paused` (gradient accumulation, ``no_sync``) the hooks only keep the
    gradients in the flat buffer and launch nothing. A second backward pass without a
    pause before :meth:`finish` raises InvalidArgument: its gradients would race with
    the pushes already launched.

    :meth:`finish` launches what is left (parameters that got no gradient), returns
    the values ``launch`` returned, in bucket order, and re-arms for the next pass.

    ``after_backward`` (optional) is called once at the end of every backward pass that
    fired a hook while not paused (queued on the autograd engine, as DDP finishes its
    reduction there); it is expected to call :meth:`finish`.
    """

    def __init__(self, flat: FlatModel, bucket_bytes: int, launch: Callable[[Bucket], Any],
                 after_backward: Callable[[], None] | None = None) -> None:
        self.flat = flat
        self.buckets = flat.buckets(bucket_bytes)
        self.paused = False
        self._launch = launch
        self._after_backward = after_backward
        self._queued = False
        self._bucket_of: dict[int, int] = {}
        for b, bucket in enumerate(self.buckets):
            for i in range(bucket.first, bucket.last + 1):
                self._bucket_of[i] = b
        # (torch leaves this method unannotated)
        self._handles = [cast(Any, p).register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(flat.params) if flat.trainable[i]]
        self._reset()

    def _reset(self) -> None:
        self._fired = [not t for t in self.flat.trainable]
        self._pending = [b.last - b.first + 1 for b in self.buckets]
        self._next = 0
        self._results: list[Any] = []
        self._queued = False

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.paused:
                self.flat.collect_grad(i)
                return
            if self._fired[i]:
                raise InvalidArgument(
                    "a second backward pass before synchronize(): its gradients would race with the "
                    "pushes of the first; accumulate micro-batches inside no_sync() (all but the last)")
            self._fired[i] = True
            self.flat.collect_grad(i)
            self._pending[self._bucket_of[i]] -= 1
            if self._after_backward is not None and not self._queued:
                self._queued = True
                queue_callback(self._end_of_backward)
            self._drain()
        return hook

    def _end_of_backward(self) -> None:
        self._queued = False
        assert self._after_backward is not None
        self._after_backward()

    def _drain(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._results.append(self._launch(self.buckets[self._next]))
            self._next += 1

    @property
    def launched(self) -> int:
        """Buckets launched so far in this pass."""
        return self._next

    def finish(self) -> list[Any]:
        """Push the buckets still waiting; the futures of every push of this backward pass."""
        for i, fired in enumerate(self._fired):
            if not fired:
                self._fired[i] = True
                self.flat.collect_grad(i)
                self._pending[self._bucket_of[i]] -= 1
        self._drain()
        results = self._results
        self._reset()
        return results

    def remove(self) -> None:
        """Remove the hooks from the model's parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
