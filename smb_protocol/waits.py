"""Who came to a wait for parties, and who is missing: the counts a barrier timeout
carries as fields (:class:`~smb_protocol.errors.BarrierTimeout`'s ``arrived``,
``parties`` and ``missing``), sent by the controller in the call's trailing metadata
and read back by the client, and the text that names the missing ranks in a message.
One module for both sides, so that the keys and their reading cannot drift apart."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from .errors import BarrierTimeout

log = logging.getLogger(__name__)

ARRIVED_KEY = "smb-arrived"   # trailing metadata: how many parties arrived (decimal)
PARTIES_KEY = "smb-parties"   # how many were expected (decimal)
MISSING_KEY = "smb-missing"   # the ranks that did not come, comma-separated ("" for none)


def ranks_text(ranks: Sequence[int] | None) -> str:
    """``"; missing: rank 1, 3"`` (empty when unknown or none)."""
    if not ranks:
        return ""
    return "; missing: rank " + ", ".join(str(r) for r in ranks)


def metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries a barrier timeout's known counts (none for
    other errors)."""
    if not isinstance(exc, BarrierTimeout):
        return ()
    out = []
    if exc.arrived is not None:
        out.append((ARRIVED_KEY, str(exc.arrived)))
    if exc.parties is not None:
        out.append((PARTIES_KEY, str(exc.parties)))
    if exc.missing is not None:
        out.append((MISSING_KEY, ",".join(str(r) for r in exc.missing)))
    return tuple(out)


def read_metadata(exc: BaseException, items: Iterable[tuple[str, str]]) -> None:
    """Set a barrier timeout's counts from the trailing metadata :func:`metadata` wrote
    (those not sent stay None; other errors are left alone)."""
    if not isinstance(exc, BarrierTimeout):
        return
    fields = dict(items)
    try:
        if ARRIVED_KEY in fields:
            exc.arrived = int(fields[ARRIVED_KEY])
        if PARTIES_KEY in fields:
            exc.parties = int(fields[PARTIES_KEY])
        if MISSING_KEY in fields:
            exc.missing = [int(r) for r in fields[MISSING_KEY].split(",") if r]
    except ValueError:
        log.warning("a barrier timeout came with malformed counts %s; they are left unknown", fields)
