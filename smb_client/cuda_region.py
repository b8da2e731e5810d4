"""Region operations on CUDA tensors (:meth:`Region.write <smb_client.region.Region.write>`,
``read_into``, ``accumulate``, ``axpy`` and the batched forms), staged through the pinned
buffers of :mod:`.cuda`; and the caller's stream kept by the asyncio forms.

Region handles are typed ``Any`` here: this module sits below :mod:`.region`, which
calls it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .cuda import Stager, _contiguous, _host_view, _nbytes, is_cuda, stager_for

__all__ = ["write", "accumulate", "read_into", "write_many", "read_many", "on_caller_stream"]

T = TypeVar("T")


# -- region operations -----------------------------------------------------------------
def write(region: Any, offset: int, data: Any, stager: Stager | None = None) -> None:
    """:meth:`Region.write <smb_client.region.Region.write>` of a CUDA tensor."""
    region.route.check_writable()
    src = _contiguous(data, False)
    region.layout.check_range(offset, _nbytes(src))
    (stager or stager_for(src)).push(src, lambda off, host: region.write(offset + off, host))


def accumulate(region: Any, offset: int, data: Any, dtype: Any = None, alpha: float | None = None,
               stager: Stager | None = None) -> None:
    """:meth:`Region.accumulate <smb_client.region.Region.accumulate>` (``alpha`` None)
    or :meth:`~smb_client.region.Region.axpy` of a CUDA tensor."""
    region.route.check_writable()
    src = _contiguous(data, False)
    region.layout.check_range(offset, _nbytes(src))
    if alpha is None:
        def send(off: int, host: Any) -> None:
            region.accumulate(offset + off, host, dtype)
    else:
        a = float(alpha)

        def send(off: int, host: Any) -> None:
            region.axpy(offset + off, host, a, dtype)
    (stager or stager_for(src)).push(src, send)


def read_into(region: Any, offset: int, out: T, stager: Stager | None = None) -> T:
    """:meth:`Region.read_into <smb_client.region.Region.read_into>` of a CUDA tensor."""
    dst = _contiguous(out, True)
    region.layout.check_range(offset, _nbytes(dst))
    (stager or stager_for(dst)).pull(dst, lambda off, host: region.read_into(offset + off, host))
    return out


def _staged_items(items: Iterable[tuple[int, Any]], stager: Stager | None
                  ) -> tuple[list[tuple[int, Any]], list[tuple[Stager, Any]]]:
    """Each CUDA item copied whole to the host (the others as given); the mirrors to return."""
    out, mirrors = [], []
    for offset, data in items:
        if is_cuda(data):
            st = stager or stager_for(data)
            host, mirror = st.to_host(_contiguous(data, False))
            mirrors.append((st, mirror))
            out.append((offset, host))
        else:
            out.append((offset, data))
    return out, mirrors


def write_many(region: Any, items: Iterable[tuple[int, Any]], accumulate_as: Any = False,
               stager: Stager | None = None) -> None:
    """:meth:`Region.write_many <smb_client.region.Region.write_many>` (or, with
    ``accumulate_as`` a dtype or None, ``accumulate_many``) of items some of which are
    CUDA tensors: those are copied to the host first."""
    staged, mirrors = _staged_items(items, stager)
    try:
        if accumulate_as is False:
            region.write_many(staged)
        else:
            region.accumulate_many(staged, accumulate_as)
    finally:
        for st, mirror in mirrors:
            st.unmirror(mirror)


def read_many(region: Any, items: Iterable[tuple[int, Any]], stager: Stager | None = None) -> list[Any]:
    """:meth:`Region.read_many <smb_client.region.Region.read_many>` into buffers some
    of which are CUDA tensors: those are read into host copies, then copied over."""
    given = list(items)
    host_items: list[tuple[int, Any]] = []
    back: list[tuple[Stager, Any, Any]] = []   # stager, mirror, device tensor
    for offset, out in given:
        if is_cuda(out):
            dst = _contiguous(out, True)
            st = stager or stager_for(dst)
            mirror = st.mirror(_nbytes(dst))
            back.append((st, mirror, dst))
            host_items.append((offset, _host_view(mirror, dst.dtype)))
        else:
            host_items.append((offset, out))
    try:
        region.read_many(host_items)
    except BaseException:
        for st, mirror, _ in back:
            st.unmirror(mirror)
        raise
    for st, mirror, dst in back:
        st.to_device(mirror, dst)
    return [out for _, out in given]


def on_caller_stream(fn: Callable[..., T], values: Sequence[Any]) -> Callable[..., T]:
    """``fn``, to be run on another thread, with the caller's current CUDA stream made
    current there too when ``values`` (or the pairs of a list among them) hold a CUDA
    tensor, so that staging orders itself after the caller's work; else ``fn``."""
    tensor = next((v for v in _candidates(values) if is_cuda(v)), None)
    if tensor is None:
        return fn
    import torch
    stream = torch.cuda.current_stream(tensor.device)

    def run(*args: Any, **kwargs: Any) -> T:
        with torch.cuda.stream(stream):
            return fn(*args, **kwargs)
    return run


def _candidates(values: Sequence[Any]) -> Iterable[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            for item in v:
                if isinstance(item, tuple) and len(item) == 2:
                    yield item[1]
                else:
                    yield item
        else:
            yield v
