"""A parameter store shared by the ranks of a threaded training test: rank 0 makes it and
deletes it at the end, the others attach to it and close their handles."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from smb_client import Client
from smb_client.torch import ParameterStore
from smb_server.testing import run_ranks

READY_WAIT = 30.0   # seconds a rank waits for rank 0's store


def rank_store(c: Client, rank: int, name: str, model: Any, ready: threading.Event,
               **create: Any) -> ParameterStore:
    """Rank 0 creates store ``name`` for ``model`` (``create``: options of
    :meth:`ParameterStore.create`) and sets ``ready``; the others attach once it is set."""
    if rank == 0:
        store = ParameterStore.create(c, name, model, **create)
        ready.set()
        return store
    assert ready.wait(READY_WAIT)
    return ParameterStore.attach(c, name, model)


def release(store: ParameterStore, rank: int) -> None:
    """Rank 0 deletes the store's regions; the others close their handles."""
    if rank == 0:
        store.destroy()
    else:
        store.close()


def run_on_one_store(cluster: Any, name: str, models: Sequence[Any],
                     body: Callable[[int, Client, ParameterStore], Any], **create: Any) -> list[Any]:
    """Run ``body(rank, client, store)`` in a thread per model, each with a client of its
    own: store ``name`` is made for ``models[0]`` (``create``: options of
    :meth:`ParameterStore.create`) before the threads start and is rank 0's; the other
    ranks attach with their model and close their handles when ``body`` returns. The
    store is deleted at the end. Returns what ``body`` returned, by rank."""
    with cluster.client() as master:
        store0 = ParameterStore.create(master, name, models[0], **create)
        try:
            def worker(rank: int) -> Any:
                with cluster.client() as c:
                    store = store0 if rank == 0 else ParameterStore.attach(c, name, models[rank])
                    try:
                        return body(rank, c, store)
                    finally:
                        if rank:
                            store.close()
            return run_ranks(len(models), worker)
        finally:
            store0.destroy()
