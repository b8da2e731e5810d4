"""Errors as an operator meets them through the `smb` command and the client, on real
processes: each names what failed and what to do next."""
from __future__ import annotations

import os

import numpy as np
import pytest

import smb_client
from smb_protocol import errors
from tests.integration.daemons import free_port, smb


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMB_")}
    env.update(extra)
    return env


def test_a_wrong_controller_address_names_smb_controller_and_the_address():
    address = f"127.0.0.1:{free_port()}"          # nothing listens there
    out = smb("region", "ls", env=_env(SMB_CONTROLLER=address, SMB_TOKEN="t"))
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "ControllerUnavailable" in out.stderr
    assert f"cannot reach the controller at {address} (from SMB_CONTROLLER)" in out.stderr
    assert "failed to connect to all addresses" not in out.stderr     # not gRPC's own words
    with smb_client.connect(address, "t", reconnect_timeout=0.2) as c:
        with pytest.raises(errors.ControllerUnavailable, match=f"{address} \\(as given\\).*SMB_CONTROLLER"):
            c.list_regions()


def test_server_unavailable_names_the_server_id_and_smb_status(fresh_cluster):
    with fresh_cluster.client(transport="tcp", reconnect_timeout=1.0) as c:
        r = c.create_region("job/down", 1 << 20, placement="single")
        r.write(0, np.ones(1 << 18, np.float32))
        victim = r.extents[0].server_id
        fresh_cluster.kill_server([i for i in range(2) if fresh_cluster.server_id(i) == victim][0])
        with pytest.raises(errors.ServerUnavailable) as info:
            r.read(0, 1 << 20)
        assert f"memory server {victim}" in str(info.value) and "smb status" in str(info.value)


def test_region_create_without_a_size_is_a_usage_error():
    out = smb("region", "create", "job/nosize", env=_env(SMB_CONTROLLER=f"127.0.0.1:{free_port()}"))
    assert out.returncode == 2
    assert "a size is required" in out.stderr and "smb region create job/nosize 256M" in out.stderr
    assert "not 0" not in out.stderr


def test_out_of_memory_and_region_exists_read_as_an_operator_would(cluster):
    env = _env(SMB_CONTROLLER=cluster.address, SMB_TOKEN=cluster.token)
    huge = smb("region", "create", "cli/huge", "1T", env=env)
    assert huge.returncode == 1
    assert "OutOfMemory" in huge.stderr and "1.0 TiB" in huge.stderr and "MiB free" in huge.stderr
    assert " bytes" not in huge.stderr, huge.stderr                    # no raw byte counts
    assert smb("region", "create", "cli/twice", "1M", env=env).returncode == 0
    try:
        again = smb("region", "create", "cli/twice", "1M", env=env)
        assert again.returncode == 1
        assert "RegionExists" in again.stderr and "smb region rm cli/twice" in again.stderr
        assert "exist_ok" not in again.stderr
    finally:
        assert smb("region", "rm", "cli/twice", env=env).returncode == 0


@pytest.mark.parametrize(("argv", "words"), [
    (["region", "create", "--help"], ["--placement", "--segments", "--replicas", "SIZE"]),
    (["up", "--help"], ["SMB_TOKEN", "smb down", "--metrics", "--env-file"]),
    (["down", "--help"], ["pid file", "--workdir"]),
    (["doctor", "--help"], ["memlock", "self-test", "exit 0"]),
])
def test_subcommand_help_describes_it(argv, words):
    out = smb(*argv, env=_env())
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for word in words:
        assert word in text, (argv, word, out.stdout)
