"""Collective.server_weights: the server weights a collective asks for, from the
workers' hosts and the servers named (no cluster: a stub lists the servers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from smb_client.collective import Collective
from smb_protocol import errors


class _Client:
    def __init__(self, servers: dict[str, str], down: tuple[str, ...] = ()) -> None:
        self.servers = [SimpleNamespace(server_id=s, host_id=h, state="down" if s in down else "up")
                        for s, h in servers.items()]

    def list_servers(self) -> list[SimpleNamespace]:
        return self.servers


MIXED = {"c0": "w0", "c1": "w1", "d0": "m0", "d1": "m1"}   # two on workers' hosts, two of their own


def test_no_arguments_keep_the_default_placement():
    assert Collective.server_weights(_Client(MIXED)) is None


def test_worker_hosts_give_colocated_servers_half_a_dedicated_share():
    w = Collective.server_weights(_Client(MIXED), worker_hosts=["w0", "w1", "w2", "w3"])
    assert w == pytest.approx({"c0": 1 / 6, "c1": 1 / 6, "d0": 1 / 3, "d1": 1 / 3})


def test_dedicated_servers_enough_leave_colocated_ones_out():
    servers = {f"c{i}": f"w{i}" for i in range(4)} | {f"d{j}": f"m{j}" for j in range(4)}
    w = Collective.server_weights(_Client(servers), worker_hosts=[f"w{i}" for i in range(4)])
    assert w == pytest.approx({f"d{j}": 0.25 for j in range(4)})


def test_named_servers_without_hosts_split_evenly_and_down_ones_are_refused():
    client = _Client(MIXED, down=("d1",))
    assert Collective.server_weights(client, servers=["c0", "d0"]) == {"c0": 1.0, "d0": 1.0}
    assert Collective.server_weights(client, servers={"c0": 2, "d0": 0}) == {"c0": 2.0}
    with pytest.raises(errors.InvalidArgument, match="not up"):
        Collective.server_weights(client, servers=["d1"])
    with pytest.raises(errors.InvalidArgument):
        Collective.server_weights(client, servers="c0")
