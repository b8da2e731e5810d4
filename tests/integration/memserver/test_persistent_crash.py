"""What a memory server acknowledged for a persistent region survives ``kill -9`` of the
server process: real ``smb server`` processes with a data directory, writes and
accumulates over tcp and writes through shm, SIGKILL, a restart on the same state and
data directories, and a byte-exact read.

The periodic write-back is set to an hour, so only the keeper can have kept the writes
(before it existed, everything written since the region was made read back as zeros).
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from smb_server.commands.local_cluster import LocalCluster

MiB = 1 << 20
WAIT = 30.0   # seconds a restarted server may take to come back up


def wait_up(cluster: LocalCluster, client, i: int) -> None:
    deadline = time.monotonic() + WAIT
    while {s.server_id: s.state for s in client.list_servers()}.get(cluster.server_id(i)) != "up":
        assert time.monotonic() < deadline, "the restarted server did not come back up"
        time.sleep(0.05)


def keepers(data_dir: str) -> list[int]:
    """Pids of keeper processes serving ``data_dir``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and b"smb_server.memserver.keeper" in argv and os.fsencode(data_dir) in argv:
            out.append(int(pid))
    return out


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"), persistent=True,
                      transports="tcp,shm", env={"SMB_WRITEBACK_SECONDS": "3600"},
                      log_level="INFO") as c:
        yield c


def test_acknowledged_writes_to_a_persistent_region_survive_kill_9(cluster):
    data_dir = str(cluster.workdir / "server-0" / "data")
    rng = np.random.default_rng(4)
    written = rng.integers(0, 256, 3 * MiB, dtype=np.uint8)
    base = rng.standard_normal(MiB // 4).astype(np.float32)
    delta = rng.standard_normal(MiB // 4).astype(np.float32)
    through_shm = rng.integers(0, 256, MiB, dtype=np.uint8)
    with cluster.client(transport="tcp") as tcp, cluster.client(transport="shm") as shm:
        region = tcp.create_region("crash/keep", 6 * MiB, placement="single", persistent=True)
        region.write(0, written)                          # tcp writes
        region.write(3 * MiB, base)
        region.accumulate(3 * MiB, delta)                 # a server-side sum
        local = shm.open_region("crash/keep")
        assert set(local.transports().values()) == {"shm"}
        local.write(4 * MiB, through_shm)                 # straight into the memory
        region.fetch_add(5 * MiB, 41)
        region.fetch_add(5 * MiB, 1)
        expected = region.read(0, 6 * MiB)
        assert keepers(data_dir), "no keeper holds the region's memory"

        cluster.kill_server(0, signal.SIGKILL)
        assert cluster.servers[0].returncode == -signal.SIGKILL
        cluster.start_server(0)
        wait_up(cluster, tcp, 0)

        back = tcp.open_region("crash/keep")
        got = back.read(0, 6 * MiB)
        assert got == expected                            # byte-exact
        assert np.frombuffer(got[:3 * MiB], np.uint8).tobytes() == written.tobytes()
        np.testing.assert_array_equal(np.frombuffer(got[3 * MiB:4 * MiB], np.float32), base + delta)
        assert got[4 * MiB:5 * MiB] == through_shm.tobytes()
        assert int.from_bytes(got[5 * MiB:5 * MiB + 8], "little") == 42
        back.write(0, b"after the restart")               # and it keeps working
        assert back.read(0, 17) == b"after the restart"
        assert len(keepers(data_dir)) == 1


def test_the_keeper_writes_back_when_its_server_dies(cluster):
    """The server is killed, then the keeper too once it wrote the extent back: the
    restarted server adopts files that hold every acknowledged write."""
    data_dir = str(cluster.workdir / "server-0" / "data")
    data = np.arange(MiB // 8, dtype=np.int64)
    with cluster.client(transport="tcp") as c:
        region = c.create_region("crash/files", MiB, placement="single", persistent=True)
        region.write(0, data)
        (keeper,) = keepers(data_dir)
        cluster.kill_server(0, signal.SIGKILL)
        (path,) = [os.path.join(data_dir, n) for n in os.listdir(data_dir) if n.endswith(".extent")]
        deadline = time.monotonic() + WAIT
        while np.fromfile(path, dtype=np.int64, count=MiB // 8, offset=4096).tolist() != data.tolist():
            assert time.monotonic() < deadline, "the keeper did not write the extent back"
            time.sleep(0.05)
        os.kill(keeper, signal.SIGKILL)
        cluster.start_server(0)
        wait_up(cluster, c, 0)
        np.testing.assert_array_equal(c.open_region("crash/files").read(dtype="int64"), data)


def test_a_clean_stop_ends_the_keeper(cluster):
    data_dir = str(cluster.workdir / "server-0" / "data")
    with cluster.client(transport="tcp") as c:
        region = c.create_region("crash/stop", MiB, placement="single", persistent=True)
        region.write(0, b"kept")
        assert len(keepers(data_dir)) == 1
        cluster.kill_server(0, signal.SIGTERM)
        assert cluster.servers[0].returncode == 0
        assert keepers(data_dir) == []
        cluster.start_server(0)
        wait_up(cluster, c, 0)
        assert c.open_region("crash/stop").read(0, 4) == b"kept"
