"""Replica roles: the stored and sent strings stay what they were."""
import json
import sqlite3

import pytest

from smb_protocol.replicas import ASSIGNABLE, CONFIGURABLE, IN_SYNC, ReplicaRole


def test_role_values_are_the_stored_strings():
    assert [r.value for r in ReplicaRole] == ["", "primary", "backup", "syncing", "stale"]
    assert ReplicaRole.PRIMARY == "primary" and str(ReplicaRole.BACKUP) == "backup"
    assert f"{ReplicaRole.SYNCING}" == "syncing"
    assert json.dumps([ReplicaRole.STALE, ReplicaRole.NONE]) == '["stale", ""]'
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (role TEXT)")
    db.execute("INSERT INTO t VALUES (?)", (ReplicaRole.PRIMARY,))
    assert db.execute("SELECT role, typeof(role) FROM t").fetchone() == ("primary", "text")


def test_role_sets():
    assert ASSIGNABLE == {"primary", "backup", "syncing", "stale"}
    assert IN_SYNC == {"primary", "backup"}
    assert CONFIGURABLE == ("", "primary", "backup")


def test_parse_names_the_known_roles():
    assert ReplicaRole.parse("backup") is ReplicaRole.BACKUP
    with pytest.raises(ValueError, match="'primary', 'backup'"):
        ReplicaRole.parse("leader")
