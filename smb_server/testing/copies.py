"""Every copy of a replicated region read from its own server and compared, byte for
byte: what a test or a benchmark checks after moves and failures, where reading through
the region (its primaries) would not see a backup that missed or doubled a mutation."""
from __future__ import annotations

from typing import Any

import numpy as np

from smb_client import Client
from smb_protocol import errors
from smb_protocol.placement import ExtentPlace

READ_CHUNK = 4 << 20        # bytes per read of one copy


def read_copy(c: Client, token: str, place: ExtentPlace) -> np.ndarray:
    """The bytes of one copy (``place``), read from its server under ``token``."""
    buf = np.empty(place.length, dtype=np.uint8)
    session = c.dataplane.session(place)
    for off in range(0, place.length, READ_CHUNK):
        n = min(READ_CHUNK, place.length - off)
        session.read_into(token, place.extent_id, off, [memoryview(buf.data)[off:off + n]])
    return buf


def compare_copies(c: Client, name: str) -> dict[str, Any]:
    """Read every copy of every slot of region ``name`` from its own server and compare.

    Returns ``identical`` (every slot has ``replicas`` readable copies, all equal),
    ``slots`` (per slot: its copies' servers and roles, bytes differing from the first),
    ``bytes_compared``, ``differing_bytes`` and ``unreadable`` (copies a read failed on).
    """
    info, ticket = c.open_info(name, "ro")
    places = [ExtentPlace.from_message(e) for e in info.extents] + \
        [ExtentPlace.from_message(e) for e in getattr(info, "copies", ())]
    slots: dict[int, list[ExtentPlace]] = {}
    for i, p in enumerate(places[:len(info.extents)]):
        slots.setdefault(i, []).append(p)
    for p in places[len(info.extents):]:
        slots.setdefault(p.index, []).append(p)
    compared = differing = 0
    out: list[dict[str, Any]] = []
    unreadable: list[dict[str, Any]] = []
    for slot, copies in sorted(slots.items()):
        data = []
        for p in copies:
            try:
                data.append(read_copy(c, ticket.token, p))
            except errors.SMBError as exc:
                unreadable.append({"slot": slot, "server": p.server_id, "error": f"{type(exc).__name__}: {exc}"})
        diff = max((int(np.count_nonzero(d != data[0])) for d in data[1:]), default=0)
        compared += sum(len(d) for d in data)
        differing += diff
        out.append({"slot": slot, "copies": [{"server": p.server_id, "role": p.role or "primary"} for p in copies],
                    "differing_bytes": diff})
    replicas = max(1, int(getattr(info, "replicas", 0) or 1))
    return {"state": info.state, "replicas": replicas, "slots": out, "bytes_compared": compared,
            "differing_bytes": differing, "unreadable": unreadable,
            "identical": differing == 0 and not unreadable
            and all(len(s["copies"]) == replicas for s in out)}
