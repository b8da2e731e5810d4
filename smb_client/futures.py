"""Waiting for a batch of futures: every one ends before the first error is raised (or, watched,
with a report while they run)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TypeVar

T = TypeVar("T")

__all__ = ["wait_all", "wait_failing_fast", "watch"]


def wait_all(futures: Iterable[Future[T]]) -> list[T]:
    """The results of ``futures`` in order, after all of them ended; raises the first
    error (in order) once every one has ended, so that nothing is still running on the
    caller's buffers when it gets the error."""
    results: list[T] = []
    error: BaseException | None = None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return results


def wait_failing_fast(futures: Sequence[Future[T]], abandon: Callable[[], None] | None) -> list[T]:
    """:func:`wait_all`, but once one future failed call ``abandon()`` (which must make
    the others end soon) instead of waiting for the others to end on their own; then
    raise the error that came first (the cause, not what abandoning did to the others)."""
    if abandon is not None:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        cause = next((f.exception() for f in futures if f in done and f.exception() is not None), None)
        if cause is not None:
            abandon()
            wait(futures)
            raise cause
    return wait_all(futures)


def watch(futures: Sequence[Future[T]], every: float, report: Callable[[], None]) -> None:
    """Wait for ``futures``, calling ``report()`` every ``every`` seconds while they run;
    returns once all ended or one failed."""
    while True:
        done, pending = wait(futures, timeout=every, return_when=FIRST_EXCEPTION)
        if not pending or any(f.exception() is not None for f in done):
            return
        report()
