"""Replica roles: what one copy of a replicated region's slot is.

The values are the strings the controller stores (SQLite, etcd JSON) and sends (the
``role`` fields of ``ExtentInfo`` and ``ConfigureReplicasRequest``); a member compares
equal to its string, so rows and messages read back as text match it.
"""
from __future__ import annotations

import logging
from enum import StrEnum

log = logging.getLogger(__name__)


class ReplicaRole(StrEnum):
    """The role of one copy of a slot (``NONE`` in an unreplicated region)."""

    NONE = ""
    PRIMARY = "primary"   # serves clients and forwards every mutation to the backups
    BACKUP = "backup"     # holds every acknowledged byte; takes over when the primary fails
    SYNCING = "syncing"   # being copied from the primary; not yet a backup
    STALE = "stale"       # missed mutations; to be synced again or removed

    @classmethod
    def parse(cls, text: str) -> ReplicaRole:
        """The role named ``text``; ValueError naming the known roles for anything else."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown replica role {text!r}: expected one of "
                             f"{', '.join(repr(r.value) for r in cls)}") from None


#: the roles a slot change may give a copy (every role but ``NONE``)
ASSIGNABLE = frozenset(ReplicaRole) - {ReplicaRole.NONE}
#: copies that hold every acknowledged byte
IN_SYNC = frozenset({ReplicaRole.PRIMARY, ReplicaRole.BACKUP})
#: what a memory server's extent can be configured as (syncing and stale copies are
#: configured as backups; the difference is the controller's)
CONFIGURABLE = (ReplicaRole.NONE, ReplicaRole.PRIMARY, ReplicaRole.BACKUP)
