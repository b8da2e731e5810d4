"""The process's open RDMA devices, each with its registration cache (closed at exit)."""
from __future__ import annotations

import atexit
import logging
import os
import threading

from smb_protocol.rdma import verbs

from .registration import RegistrationCache

log = logging.getLogger(__name__)


class SharedDevice:
    """One open device and the registration cache of caller buffers on it, shared by
    every session of the process (:meth:`get`); closed by :meth:`close_all` at exit."""

    _lock = threading.Lock()
    _instances: dict[str, SharedDevice] = {}

    def __init__(self, name: str | None) -> None:
        self.device = verbs.Device(name)
        self.cache = RegistrationCache(self.device)
        self._remote_cache: RegistrationCache | None = None

    @property
    def remote_cache(self) -> RegistrationCache:
        """Registrations of caller buffers that a server may RDMA-WRITE into (a
        collective's sums): LOCAL_WRITE | REMOTE_WRITE, made when first needed."""
        with self._lock:
            if self._remote_cache is None:
                import pyverbs.enums as e
                self._remote_cache = RegistrationCache(
                    self.device, writable_access=e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            return self._remote_cache

    @classmethod
    def get(cls, name: str | None = None) -> SharedDevice:
        """The shared device ``name`` (default ``$SMB_RDMA_DEVICE`` or the first active)."""
        name = name or os.environ.get(verbs.ENV_DEVICE) or None
        key = name or ""
        with cls._lock:
            inst = cls._instances.get(key)
            if inst is None:
                inst = cls._instances[key] = SharedDevice(name)
            return inst

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            insts, cls._instances = list(cls._instances.values()), {}
        for inst in insts:
            inst.cache.close()
            if inst._remote_cache is not None:
                inst._remote_cache.close()
            try:
                inst.device.close()
            except Exception as exc:  # a session still holds children
                log.debug("rdma device not closed at exit: %s", exc)


atexit.register(SharedDevice.close_all)
