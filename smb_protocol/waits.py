"""Who is missing from a wait for parties, as text: written into a barrier timeout's
message by the controller (and into the client's own reports), read back by the client.
One module for both sides, so that the format and its parser cannot drift apart."""
from __future__ import annotations

import re
from collections.abc import Sequence

_MISSING = re.compile(r"missing: rank ([\d, ]+)")


def ranks_text(ranks: Sequence[int] | None) -> str:
    """``"; missing: rank 1, 3"`` (empty when unknown or none)."""
    if not ranks:
        return ""
    return "; missing: rank " + ", ".join(str(r) for r in ranks)


def missing_ranks(error: BaseException) -> list[int] | None:
    """The ranks an error's message names as missing (None: it names none)."""
    named = _MISSING.search(str(error))
    return [int(r) for r in named.group(1).split(",")] if named else None
