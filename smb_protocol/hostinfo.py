"""Host identity: clients on the same host as a memory server may use shared memory."""
from __future__ import annotations

import functools
import os
import socket


@functools.cache
def host_id() -> str:
    """A stable identity of this machine; ``SMB_HOST_ID`` overrides it."""
    override = os.environ.get("SMB_HOST_ID")
    if override:
        return override
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                value = f.read().strip()
            if value:
                return value
        except OSError:
            continue
    return socket.gethostname()
