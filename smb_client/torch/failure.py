"""A failed store creation, told to the workers waiting for it.

When the master's :meth:`~smb_client.torch.store.ParameterStore.create` fails under
:func:`~smb_client.torch.launch.open_store`, the master writes its error into the
region ``<prefix>/failed`` (an 8-byte length, then JSON: error class name, message,
time) and raises it; the others look for that region while they wait and raise the same
error class at once. The next creation under the prefix removes the record, and a
record made with the store's ``lease`` goes with that lease, so a job that never comes
back (its name, as the DDP wrapper's, never used again) leaves nothing.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from typing import TYPE_CHECKING

from smb_protocol import errors
from smb_protocol.errors import RegionNotFound, SMBError

if TYPE_CHECKING:
    from ..client import Client

log = logging.getLogger(__name__)

KIND = "failed"       # the record's region: <prefix>/failed
SKEW = 30.0           # seconds: a record older than the wait by more is a previous run's
PAGE = 4096
LENGTH = struct.Struct("<Q")


def region_name(prefix: str) -> str:
    """The failure record's region under ``prefix``."""
    return f"{prefix}/{KIND}"


def publish(client: Client, prefix: str, exc: BaseException, lease: float | None = None) -> None:
    """Leave the master's creation error in ``<prefix>/failed`` for the workers waiting
    to attach (best effort: a failure to do so is only logged). ``lease`` (seconds): the
    record holds ``client``'s owner lease, as the store's regions would have, and is
    deleted once nobody renewed it for that long (None: it stays until the next creation
    under ``prefix`` or :func:`clear`)."""
    doc = json.dumps({"error": errors.wire_class(exc).__name__, "message": str(exc),
                      "time": time.time()}).encode()
    try:
        clear(client, prefix)
        region = client.create_region(region_name(prefix), -(-(len(doc) + LENGTH.size) // PAGE) * PAGE,
                                      placement="single", lease=lease)
        try:
            region.write(0, LENGTH.pack(len(doc)) + doc)
        finally:
            region.close()
    except Exception as marker_exc:   # noqa: BLE001 - the original error matters more
        log.warning("could not publish the creation failure of %s: %s", prefix, marker_exc)


def check(client: Client, prefix: str, since: float | None = None) -> None:
    """Raise the master's creation error if it left one under ``prefix``: the same error
    class, its message saying where it comes from. With ``since`` (a ``time.time()``), a
    record more than :data:`SKEW` seconds older is taken for an earlier run's and ignored."""
    try:
        region = client.open_region(region_name(prefix))
    except RegionNotFound:
        return
    try:
        (length,) = LENGTH.unpack(bytes(region.read(0, LENGTH.size)))
        doc = json.loads(bytes(region.read(LENGTH.size, min(length, region.size - LENGTH.size))))
    except (ValueError, SMBError, struct.error) as exc:
        doc = {"error": "ServerError", "message": f"unreadable failure record: {exc}"}
    finally:
        region.close()
    if since is not None and float(doc.get("time", since)) < since - SKEW:
        return
    kind = errors.error_class(str(doc.get("error", "ServerError")))
    raise kind(f"the master failed to create parameter store {prefix!r}: "
               f"{doc.get('error')}: {doc.get('message')}")


def clear(client: Client, prefix: str) -> None:
    """Remove the record (if any)."""
    try:
        client.delete_region(region_name(prefix))
    except RegionNotFound:
        pass
