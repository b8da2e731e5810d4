"""Shared fixtures: real local clusters (separate processes on loopback) and a real
etcd server."""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from smb_server.commands.local_cluster import LocalCluster
from smb_server.testing import EtcdNotInstalled, EtcdServer

_names = itertools.count()


@pytest.fixture(scope="session")
def cluster():
    """A controller and two memory servers shared by the non-destructive tests."""
    with LocalCluster(servers=2, capacity="512M", log_level="WARNING") as c:
        yield c


@pytest.fixture
def fresh_cluster(tmp_path):
    """A private cluster for tests that kill or restart daemons."""
    with LocalCluster(servers=2, capacity="256M", workdir=str(tmp_path / "cluster"),
                      log_level="INFO") as c:
        yield c


@pytest.fixture
def client(cluster):
    with cluster.client() as c:
        yield c


@pytest.fixture
def name():
    """A region name no other test uses."""
    return f"test/r{os.getpid()}-{next(_names)}"


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    try:
        server = EtcdServer()
    except EtcdNotInstalled as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_store(etcd_server: EtcdServer) -> str:
    """An ``etcd://`` store URL with a fresh key prefix."""
    return etcd_server.url()
