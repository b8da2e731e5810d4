"""Waiting for a batch of futures: every one ends before the first error is raised."""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

__all__ = ["wait_all"]


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
