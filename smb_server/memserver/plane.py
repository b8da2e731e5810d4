"""What a data plane served through its own :class:`.listener.Listener` shares."""
from __future__ import annotations

from typing import Self

from .listener import Listener


class ListeningPlane:
    """What a data plane served through its own :class:`Listener` (``_listener``)
    shares: its counts, a close that runs once, the ``with`` block."""

    _listener: Listener

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return self._listener.connections

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._listener.closing

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, wait for their threads (seconds);
        then :meth:`_closed`. Once: a second call returns at once."""
        if self._listener.closing:
            return
        self._listener.close(timeout)
        self._closed()

    def _closed(self) -> None:
        """What the plane releases after its listener closed."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
