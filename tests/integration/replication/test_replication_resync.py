"""A copy filled by a sync holds what the primary applied, but not the primary's
exactly-once table: a request the primary resumes afterwards must not send it the bytes
it already applied (they would be applied twice there)."""
from __future__ import annotations

import numpy as np
import pytest

from smb_protocol.errors import ServerUnavailable

from .nodes import Client


def test_a_retry_resumed_after_a_new_backup_was_filled_is_not_applied_there_again(nodes):
    primary, backup, newcomer = nodes(3)
    primary.configure(1, "primary", [backup])
    backup.configure(1, "backup")
    backup.tcp.close()                                    # the backup's data plane dies
    primary.repl.timeout = 0.5
    c = Client(primary)
    seq = next(c.seqs)
    with pytest.raises(ServerUnavailable):               # applied at the primary, not acknowledged
        c.accumulate(0, np.ones(1000, np.int64), seq=seq)
    newcomer.configure(2, "backup")                       # the controller drops the dead backup
    primary.configure(2, "primary", [newcomer], sync=[newcomer])   # and fills a new copy
    assert newcomer.data() == primary.data()
    c.accumulate(0, np.ones(1000, np.int64), seq=seq)    # the client's retry: answered as done
    assert primary.array(np.int64)[999] == 1
    assert newcomer.array(np.int64)[999] == 1             # not applied again on the new copy
    assert newcomer.data() == primary.data()
    c.close()
