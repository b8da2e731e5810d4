"""Checkpoints of a parameter store: its weights and published buffers as a state dict.

:meth:`ParameterStore.save <smb_client.torch.store.ParameterStore.save>` writes what
:func:`state_dict` returns with ``torch.save``, keyed and ordered like the bound
model's ``state_dict()``, so ``torch.load`` and ``model.load_state_dict`` read it;
:func:`load` puts such a dict into the store (``params`` and buffer slot 0) and into the
bound model. With an optimizer (or extra values such as the step) the file holds
``{"model": <state dict>, "optimizer": <optimizer.state_dict()>, **extra}`` instead,
which :func:`load` reads too; files are written whole or not at all (a temporary file,
then a rename).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import torch

from smb_protocol.errors import DtypeError, InvalidArgument

from .flat import FlatModel, torch_dtype
from .layout import FlatLayout, TensorSlot, dtype_name

PathLike: TypeAlias = "str | os.PathLike[str]"   # a checkpoint file's name


class CheckpointedStore(Protocol):
    """What a checkpoint needs of :class:`smb_client.torch.store.ParameterStore`
    (named here so that this module does not import the store that imports it)."""

    @property
    def flat(self) -> FlatModel: ...
    @property
    def layout(self) -> FlatLayout: ...
    @property
    def buffer_layout(self) -> FlatLayout | None: ...
    @property
    def buffers(self) -> list[torch.Tensor]: ...

    def read_into(self, kind: str, offset: int, out: torch.Tensor) -> torch.Tensor: ...
    def buffer_offset(self, slot: int) -> int: ...
    def push_params(self) -> None: ...
    def push_buffers(self, slot: int = 0) -> None: ...


def _unpack(raw: torch.Tensor, layout: FlatLayout, out: dict[str, torch.Tensor]) -> None:
    for t in layout.tensors:
        out[t.name] = raw[t.offset:t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape).clone()


def state_dict(store: CheckpointedStore) -> dict[str, torch.Tensor]:
    """The stored parameters (and published buffers): name -> tensor."""
    raw = torch.empty(store.layout.slot_bytes, dtype=torch.uint8)
    store.read_into("params", 0, raw)
    out: dict[str, torch.Tensor] = {}
    _unpack(raw, store.layout, out)
    if store.buffer_layout is not None:
        braw = torch.empty(store.buffer_layout.slot_bytes, dtype=torch.uint8)
        store.read_into("buffers", store.buffer_offset(0), braw)
        _unpack(braw, store.buffer_layout, out)
    order = [k for k in store.flat.model.state_dict() if k in out]   # the model's own order
    rest = [k for k in out if k not in set(order)]
    return {k: out[k] for k in order + rest}


MODEL, OPTIMIZER = "model", "optimizer"   # the keys of a checkpoint with an optimizer's state


def save(model_state: dict[str, torch.Tensor], path: PathLike, optimizer: torch.optim.Optimizer | None = None,
         **extra: Any) -> None:
    """Write ``model_state`` to ``path`` (a file name): alone, or with ``optimizer``'s
    state and ``extra`` values (see the module); atomically."""
    doc: dict[str, Any] = dict(model_state)
    if optimizer is not None or extra:
        doc = {MODEL: dict(model_state), **extra}
        if optimizer is not None:
            doc[OPTIMIZER] = optimizer.state_dict()
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    torch.save(doc, tmp)
    os.replace(tmp, target)


def read(path: PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]]:
    """A checkpoint file's model state, optimizer state (None: none saved) and extra values."""
    doc = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{path}: not a state dict ({type(doc).__name__})")
    if isinstance(doc.get(MODEL), dict):
        extra = {k: v for k, v in doc.items() if k not in (MODEL, OPTIMIZER)}
        return doc[MODEL], doc.get(OPTIMIZER), extra
    return doc, None, {}


def load(store: CheckpointedStore, path: PathLike, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Put the weights of a checkpoint (a state dict, e.g. from ``store.save`` or
    ``torch.save(model.state_dict())``, or one saved with an optimizer) into the store
    and into the bound model, and its optimizer state into ``optimizer`` (InvalidArgument
    when ``optimizer`` is given and the file holds none); returns its extra values."""
    state, opt_state, extra = read(path)
    if optimizer is not None and opt_state is None:
        raise InvalidArgument(f"{path} holds no optimizer state (save it with store.save(path, optimizer))")
    load_state_dict(store, state)
    if optimizer is not None and opt_state is not None:
        optimizer.load_state_dict(opt_state)
    return extra


def load_state_dict(store: CheckpointedStore, state: dict[str, torch.Tensor]) -> None:
    """Names, shapes and element types must match the store's (InvalidArgument or
    DtypeError naming the tensor); extra entries are ignored."""
    buffers: tuple[TensorSlot, ...] = store.buffer_layout.tensors if store.buffer_layout else ()
    tensors = list(store.layout.tensors) + list(buffers)
    missing = [t.name for t in tensors if t.name not in state]
    if missing:
        raise InvalidArgument(f"checkpoint lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for t in tensors:
        v = state[t.name]
        if tuple(v.shape) != t.shape:
            raise InvalidArgument(f"checkpoint tensor {t.name!r} {list(v.shape)} does not match the "
                                  f"store's {list(t.shape)}")
        if dtype_name(v.dtype) != t.dtype:
            raise DtypeError(f"checkpoint tensor {t.name!r} is {dtype_name(v.dtype)}, the store holds {t.dtype}")
    with torch.no_grad():
        for view, t in zip(store.flat.param_views, store.layout.tensors, strict=True):
            view.copy_(state[t.name])
        for b, t in zip(store.buffers, buffers, strict=True):
            b.copy_(state[t.name])
    store.push_params()
    store.push_buffers()
