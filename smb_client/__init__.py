"""Soft Memory Box client: named regions in a pooled RAM buffer, moved with RDMA,
TCP or shared memory.

    import smb_client
    with smb_client.connect("127.0.0.1:7700", token=...) as c:
        params = c.create_region("job/params", 64 << 20)
        params.write(0, array)
        params.accumulate(0, grads)          # server-side +=
        params.read_into(0, array)
"""
from smb_protocol.errors import *  # noqa: F401,F403
from smb_protocol.errors import SMBError

from . import errors
from .client import Client, RegionStatus, ServerStatus, connect
from .collective import Collective
from .coord import Barrier, Lock, PartiesMissing
from .region import Region
from .weights import Publisher, Shard, Subscriber

__all__ = ["Barrier", "Client", "Collective", "Lock", "PartiesMissing", "Publisher", "Region", "RegionStatus",
           "ServerStatus", "Shard", "SMBError", "Subscriber", "connect", "errors"]
