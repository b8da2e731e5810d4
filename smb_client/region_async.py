"""The asynchronous forms of a region's operations, one surface with the blocking ones.

Every data-plane call of :class:`~smb_client.region.Region` comes three ways:

* ``region.read(...)`` blocks until done;
* ``region.read_async(...)`` returns a :class:`concurrent.futures.Future` at once (the
  operation runs on the client's pool);
* ``await region.aread(...)`` is a coroutine for asyncio code: it awaits that same
  future (:func:`asyncio.wrap_future`), so the event loop goes on meanwhile.

The same arguments, results and errors in all three. Cancelling an ``a*`` coroutine
stops the operation only if it had not started; one already sent runs to its end (its
writes take effect), as a cancelled ``concurrent.futures`` operation does.
``await region.await_word(offset, value=...)`` is :meth:`Region.wait
<smb_client.region.Region.wait>`'s form (``await`` being a keyword).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from .cuda_region import on_caller_stream

if TYPE_CHECKING:
    from .route import Route

T = TypeVar("T")

__all__ = ["AsyncForms"]


class AsyncForms:
    """The ``*_async`` (futures) and ``a*`` (coroutines) forms of :class:`Region
    <smb_client.region.Region>`'s operations (a base class of it)."""

    route: Route

    if TYPE_CHECKING:   # the blocking forms, which Region defines
        def write(self, offset: int, data: Any) -> None: ...
        def read_into(self, offset: int, out: Any) -> Any: ...
        def read(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Any: ...
        def accumulate(self, offset: int, data: Any, dtype: Any = None) -> None: ...
        def axpy(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> None: ...
        def scale(self, offset: int, length: int, alpha: float, dtype: Any) -> None: ...
        def fetch_add(self, offset: int, value: int) -> int: ...
        def compare_swap(self, offset: int, expected: int, desired: int) -> int: ...
        def wait(self, offset: int, *, value: int | None = None, equals: int | None = None,
                 changed_from: int | None = None, timeout: float | None = None) -> int: ...
        def write_many(self, items: Iterable[tuple[int, Any]]) -> None: ...
        def read_many(self, items: Iterable[tuple[int, Any]]) -> list[Any]: ...
        def fetch_add_many(self, items: Iterable[tuple[int, int]]) -> list[int]: ...
        def accumulate_many(self, items: Iterable[tuple[int, Any]], dtype: Any = None) -> None: ...

    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        # a CUDA tensor's staging runs after the work queued on the caller's stream
        return self.route.submit(on_caller_stream(fn, args), *args, **kwargs)

    # -- futures --------------------------------------------------------------------
    def write_async(self, offset: int, data: Any) -> Future[None]:
        """A future of :meth:`write`."""
        return self._submit(self.write, offset, data)

    def read_into_async(self, offset: int, out: Any) -> Future[Any]:
        """A future of :meth:`read_into` (its result: ``out``)."""
        return self._submit(self.read_into, offset, out)

    def read_async(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Future[Any]:
        """A future of :meth:`read`'s buffer."""
        return self._submit(self.read, offset, length, dtype)

    def accumulate_async(self, offset: int, data: Any, dtype: Any = None) -> Future[None]:
        """A future of :meth:`accumulate`."""
        return self._submit(self.accumulate, offset, data, dtype)

    def axpy_async(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> Future[None]:
        """A future of :meth:`axpy`."""
        return self._submit(self.axpy, offset, x, alpha, dtype)

    def scale_async(self, offset: int, length: int, alpha: float, dtype: Any) -> Future[None]:
        """A future of :meth:`scale`."""
        return self._submit(self.scale, offset, length, alpha, dtype)

    def fetch_add_async(self, offset: int, value: int) -> Future[int]:
        """A future of :meth:`fetch_add`'s old value."""
        return self._submit(self.fetch_add, offset, value)

    def compare_swap_async(self, offset: int, expected: int, desired: int) -> Future[int]:
        """A future of :meth:`compare_swap`'s old value."""
        return self._submit(self.compare_swap, offset, expected, desired)

    def wait_async(self, offset: int, *, value: int | None = None, equals: int | None = None,
                   changed_from: int | None = None, timeout: float | None = None) -> Future[int]:
        """A future of :meth:`wait`'s word (it holds a pool thread while it waits)."""
        return self._submit(self.wait, offset, value=value, equals=equals, changed_from=changed_from,
                            timeout=timeout)

    def write_many_async(self, items: Sequence[tuple[int, Any]]) -> Future[None]:
        """A future of :meth:`write_many`."""
        return self._submit(self.write_many, items)

    def read_many_async(self, items: Sequence[tuple[int, Any]]) -> Future[list[Any]]:
        """A future of :meth:`read_many`'s list of buffers."""
        return self._submit(self.read_many, items)

    def accumulate_many_async(self, items: Sequence[tuple[int, Any]], dtype: Any = None) -> Future[None]:
        """A future of :meth:`accumulate_many`."""
        return self._submit(self.accumulate_many, items, dtype)

    def fetch_add_many_async(self, items: Sequence[tuple[int, int]]) -> Future[list[int]]:
        """A future of :meth:`fetch_add_many`'s old values."""
        return self._submit(self.fetch_add_many, items)

    # -- coroutines -----------------------------------------------------------------
    async def awrite(self, offset: int, data: Any) -> None:
        """:meth:`write`, awaited."""
        await asyncio.wrap_future(self.write_async(offset, data))

    async def aread_into(self, offset: int, out: Any) -> Any:
        """:meth:`read_into`, awaited (returns ``out``)."""
        return await asyncio.wrap_future(self.read_into_async(offset, out))

    async def aread(self, offset: int = 0, length: int | None = None, dtype: Any = None) -> Any:
        """:meth:`read`, awaited (returns the buffer)."""
        return await asyncio.wrap_future(self.read_async(offset, length, dtype))

    async def aaccumulate(self, offset: int, data: Any, dtype: Any = None) -> None:
        """:meth:`accumulate`, awaited."""
        await asyncio.wrap_future(self.accumulate_async(offset, data, dtype))

    async def aaxpy(self, offset: int, x: Any, alpha: float, dtype: Any = None) -> None:
        """:meth:`axpy`, awaited."""
        await asyncio.wrap_future(self.axpy_async(offset, x, alpha, dtype))

    async def ascale(self, offset: int, length: int, alpha: float, dtype: Any) -> None:
        """:meth:`scale`, awaited."""
        await asyncio.wrap_future(self.scale_async(offset, length, alpha, dtype))

    async def afetch_add(self, offset: int, value: int) -> int:
        """:meth:`fetch_add`, awaited (returns the old value)."""
        return await asyncio.wrap_future(self.fetch_add_async(offset, value))

    async def acompare_swap(self, offset: int, expected: int, desired: int) -> int:
        """:meth:`compare_swap`, awaited (returns the old value)."""
        return await asyncio.wrap_future(self.compare_swap_async(offset, expected, desired))

    async def await_word(self, offset: int, *, value: int | None = None, equals: int | None = None,
                         changed_from: int | None = None, timeout: float | None = None) -> int:
        """:meth:`wait`, awaited (returns the word)."""
        return await asyncio.wrap_future(self.wait_async(offset, value=value, equals=equals,
                                                         changed_from=changed_from, timeout=timeout))

    async def awrite_many(self, items: Sequence[tuple[int, Any]]) -> None:
        """:meth:`write_many`, awaited."""
        await asyncio.wrap_future(self.write_many_async(items))

    async def aread_many(self, items: Sequence[tuple[int, Any]]) -> list[Any]:
        """:meth:`read_many`, awaited (returns the buffers)."""
        return await asyncio.wrap_future(self.read_many_async(items))

    async def aaccumulate_many(self, items: Sequence[tuple[int, Any]], dtype: Any = None) -> None:
        """:meth:`accumulate_many`, awaited."""
        await asyncio.wrap_future(self.accumulate_many_async(items, dtype))

    async def afetch_add_many(self, items: Sequence[tuple[int, int]]) -> list[int]:
        """:meth:`fetch_add_many`, awaited (returns the old values)."""
        return await asyncio.wrap_future(self.fetch_add_many_async(items))
