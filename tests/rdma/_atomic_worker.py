"""A child process of test_atomics_from_four_processes (kept free of heavy imports)."""
from __future__ import annotations

import traceback
from typing import Any


def adder(uri: str, token: str, extent: int, n: int, q: Any) -> None:
    """fetch_add 1, ``n`` times, on the word at byte 8; put ``("ok", old values)`` on
    ``q``, or ``("error", traceback)`` so the test fails with the child's reason."""
    try:
        from smb_client.transports.rdma import RdmaSession
        from smb_protocol.addressing import parse_endpoint
        s = RdmaSession(parse_endpoint(uri), {})
        olds = [s.fetch_add(token, extent, 8, 1) for _ in range(n)]
        s.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
    q.put(("ok", olds))
