"""open_store's arguments are checked against the launch before anyone waits: more
members than workers can never all arrive."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import WorkerEnv, open_store  # noqa: E402
from smb_protocol.errors import InvalidArgument  # noqa: E402


class NoCalls:
    """A client that must not be used: the check comes first."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"open_store called client.{name} before checking its arguments")


@pytest.mark.parametrize("rank", [0, 1])
def test_more_members_than_workers_fail_at_once_naming_both(rank):
    t0 = time.monotonic()
    with pytest.raises(InvalidArgument, match=r"members=3.*WORLD_SIZE=2") as info:
        open_store(NoCalls(), WorkerEnv(rank=rank, world_size=2), "job", torch.nn.Linear(2, 2),  # type: ignore[arg-type]
                   members=3)
    assert time.monotonic() - t0 < 1.0
    assert "members" in str(info.value) and "never" in str(info.value)
