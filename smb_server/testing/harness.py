"""The harness of threaded checks: :func:`run_ranks` runs one function per rank, each in
a thread of its own, and hands back their results or the first failure
(:func:`rank_failures`: the failures, for a check that expects them); :func:`spawn_ranks`
does the same with a process per rank; :func:`wait_until` polls a condition until it
holds, with a deadline."""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

WAIT = 30.0      # seconds a condition gets to hold (a daemon to come up, a state to be reached)
RANKS = 120.0    # seconds every rank of :func:`run_ranks` gets to finish, all together
POLL = 0.05      # seconds between two looks at a condition

T = TypeVar("T")


def wait_until(cond: Callable[[], T | None], what: str, timeout: float = WAIT, pause: float = POLL) -> T:
    """Call ``cond`` every ``pause`` seconds until it returns something true, and return
    that; :class:`TimeoutError` naming ``what`` once ``timeout`` seconds have passed.
    An exception ``cond`` raises ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(pause)


def run_ranks(world: int, fn: Callable[[int], T], timeout: float = RANKS) -> list[T]:
    """Run ``fn(rank)`` for every rank in ``range(world)``, each in a daemon thread of its
    own, and return the results by rank. The first failure (the earliest to happen) is
    raised again, the later ones are added to it as notes; a rank still running after
    ``timeout`` seconds fails with :class:`TimeoutError` naming it."""
    results, failed, running = _in_threads(world, fn, timeout)
    if failed:
        rank, first = failed[0]
        for other, exc in failed[1:]:
            first.add_note(f"rank {other} failed too: {type(exc).__name__}: {exc}")
        if running:
            first.add_note(f"ranks {running} were still running after {timeout:g} s")
        first.add_note(f"raised on rank {rank} of {world}")
        raise first
    if running:
        raise TimeoutError(f"ranks {running} of {world} still running after {timeout:g} s")
    return [results[rank] for rank in range(world)]


def rank_failures(world: int, fn: Callable[[int], object], timeout: float = RANKS) -> list[BaseException]:
    """Run ``fn(rank)`` for every rank as :func:`run_ranks` does, for a check that expects
    ranks to fail: the exceptions they raised, in the order they happened (empty when none
    did); a rank still running after ``timeout`` seconds fails with :class:`TimeoutError`."""
    _, failed, running = _in_threads(world, fn, timeout)
    if running:
        raise TimeoutError(f"ranks {running} of {world} still running after {timeout:g} s")
    return [exc for _, exc in failed]


def _in_threads(world: int, fn: Callable[[int], T], timeout: float
                ) -> tuple[dict[int, T], list[tuple[int, BaseException]], list[int]]:
    """``fn(rank)`` in a daemon thread per rank, joined within ``timeout`` seconds: the
    results by rank, the (rank, exception) failures in the order they happened, and the
    ranks still running."""
    results: dict[int, T] = {}
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def main(rank: int) -> None:
        try:
            out = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - raised again by the caller's thread
            with lock:
                failures.append((rank, exc))
            return
        with lock:
            results[rank] = out

    threads = [threading.Thread(target=main, args=(rank,), name=f"rank-{rank}", daemon=True)
               for rank in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    running = [rank for rank, t in enumerate(threads) if t.is_alive()]
    with lock:
        return dict(results), list(failures), running


def spawn_ranks(world: int, target: Callable[..., None], *args: Any, timeout: float = RANKS) -> list[Any]:
    """Run ``target(rank, queue, *args)`` for every rank in ``range(world)``, each in a
    process of its own (``spawn``: ``target`` is importable); each puts ``(rank, result)``
    on ``queue``, or ``(rank, text)`` with the text (a ``str``) of its failure. The results
    by rank, once every rank put one within ``timeout`` seconds; :class:`RankFailed`
    naming the first rank that sent a failure. The processes are joined (killed after
    30 s)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, queue, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank in range(world):
        if isinstance(results[rank], str):
            raise RankFailed(f"rank {rank} failed:\n{results[rank]}")
    return [results[r] for r in range(world)]


class RankFailed(AssertionError):
    """A rank of :func:`spawn_ranks` sent its failure instead of a result."""
