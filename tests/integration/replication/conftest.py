"""Fixtures of the replication tests."""
from __future__ import annotations

import pytest

from .nodes import SIZE, Node


@pytest.fixture
def nodes(tmp_path):
    made: list[Node] = []

    def make(n: int, size: int = SIZE) -> list[Node]:
        for _ in range(n):
            made.append(Node(f"srv{len(made)}", 100 + len(made), tmp_path, size))
        return made[-n:]
    yield make
    for node in made:
        node.close()
