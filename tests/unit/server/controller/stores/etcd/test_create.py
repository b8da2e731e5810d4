"""Region creates on the etcd store, which plans and writes the creates that queue
meanwhile together: the same rules as one at a time, against a real etcd server."""
from __future__ import annotations

import threading

import pytest

from smb_protocol import errors
from smb_server.controller.records import CreateRequest, RegionRecord
from smb_server.controller.stores.etcd.state import EtcdState

MiB = 1 << 20


def _together(n: int, body: object) -> list[RegionRecord | errors.SMBError]:
    """Run ``body(k)`` in ``n`` threads released at once; their results or errors."""
    start = threading.Barrier(n)
    out: list[RegionRecord | errors.SMBError] = [errors.SMBError("not run")] * n

    def run(k: int) -> None:
        start.wait()
        try:
            out[k] = body(k)  # type: ignore[operator]
        except errors.SMBError as exc:
            out[k] = exc
    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_creates_never_overfill_a_server(etcd_store: str) -> None:
    state = EtcdState(etcd_store)
    state.register_server("s1", "h", "127.0.0.1:1", [], 20 * MiB)
    results = _together(32, lambda k: state.begin_create_region(CreateRequest(f"job/{k}", MiB, placement="single")))
    made = [r for r in results if isinstance(r, RegionRecord)]
    refused = [r for r in results if isinstance(r, errors.OutOfMemory)]
    assert len(made) == 20 and len(refused) == 12
    ids = [e.extent_id for r in made for e in r.extents]
    assert len(set(ids)) == len(ids)                       # no extent id handed out twice
    assert state.get_server("s1").used == 20 * MiB
    for r in made:
        assert state.commit_region(r.name, r.uid).state == "ready"
    assert len(state.list_regions()) == 20


def test_one_of_concurrent_creates_of_a_name_wins(etcd_store: str) -> None:
    state = EtcdState(etcd_store)
    state.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    results = _together(8, lambda k: state.begin_create_region(CreateRequest("job/same", MiB)))
    assert sum(isinstance(r, RegionRecord) for r in results) == 1
    assert sum(isinstance(r, errors.RegionExists) for r in results) == 7


def test_a_commit_finds_a_region_removed_meanwhile(etcd_store: str) -> None:
    a = EtcdState(etcd_store)
    a.register_server("s1", "h", "127.0.0.1:1", [], 64 * MiB)
    region = a.begin_create_region(CreateRequest("job/x", MiB))
    assert EtcdState(etcd_store, recover=False).recover() == ["job/x"]   # another controller removed it
    with pytest.raises(errors.RegionNotFound):
        a.commit_region("job/x", region.uid)
