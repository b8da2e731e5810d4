"""A parameter store shared by the ranks of a threaded training test: rank 0 makes it and
deletes it at the end, the others attach to it and close their handles."""
from __future__ import annotations

import threading
from typing import Any

from smb_client import Client
from smb_client.torch import ParameterStore

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
