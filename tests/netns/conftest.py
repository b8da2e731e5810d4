"""The netns tier: a cluster on one machine (bench/cluster), memory servers and workers
on separate network namespaces with capped links.

Needs root and iproute2 (``ip netns``, ``tc``); elsewhere every test here is skipped with
the reason. CI runs it as root, where it must run.
"""
from __future__ import annotations

import os

import pytest

from bench.cluster import netns

_reason: str | None = None
_probed = False


def unavailable() -> str | None:
    """Why this tier cannot run here (probed once), or None."""
    global _reason, _probed
    if not _probed:
        _reason = netns.unavailable_reason()
        _probed = True
    return _reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    reason = unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"netns tier: {reason}")
    for item in mine:
        item.add_marker(skip)
