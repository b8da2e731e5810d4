"""What a same-host client of another user gets through shm cannot reach beyond its
ticket: a real memory server (running as root) hands extent descriptors to a client
process running as ``nobody``, which then tries every way out it has (reopen through
/proc, truncate, grow, seal, mprotect, punch) on memory and file-backed extents. The
server stays up and the data stays as the tickets allowed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from smb_server.commands.local_cluster import LocalCluster

MiB = 1 << 20
OTHER_UID = 65534          # nobody
OTHER_GID = 65534
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")

# Runs as another user: asks the server for an extent with a ticket, then attacks what it
# got. Prints one JSON object: attempt name -> "ok" or the refusing errno's name.
CHILD = r'''
import ctypes, errno, fcntl, json, mmap, os, sys
from smb_client import errors
from smb_client.transports.shm import fetch_extent_fd

req = json.load(sys.stdin)
out = {"uid": os.getuid()}
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_REMOVE = 9

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))

def check(rc):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

fd, length, writable = fetch_extent_fd(req["path"], req["ticket"], req["extent_id"])
size = 4096 + length
out["writable"] = writable
m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
out["data"] = m[4096:4096 + 16].hex()
attempt("reopen_rw", lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
attempt("shrink", lambda: os.ftruncate(fd, 4096))
attempt("grow", lambda: os.ftruncate(fd, size + (1 << 20)))
attempt("fallocate_grow", lambda: os.posix_fallocate(fd, size, 1 << 20))
attempt("seal_write", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
attempt("seal_future_write", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x0010))
attempt("chmod", lambda: os.fchmod(fd, 0o666))
attempt("map_writable", lambda: mmap.mmap(fd, size, mmap.MAP_SHARED,
                                          mmap.PROT_READ | mmap.PROT_WRITE).close())
if not writable:   # a writable descriptor may do both: its ticket lets it write anything
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    attempt("mprotect_writable", lambda: check(libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE)))
    attempt("madvise_remove", lambda: check(libc.madvise(addr, size, MADV_REMOVE)))
if writable and req.get("write"):
    w = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    w[4096:4096 + 4] = bytes.fromhex(req["write"])
    w.close()
    out["wrote"] = True
out["size_after"] = os.fstat(fd).st_size
if req.get("unreachable"):
    try:
        fetch_extent_fd(req["unreachable"], req["ticket"], req["extent_id"])
        out["unreachable"] = "ok"
    except errors.SMBError as exc:
        out["unreachable"] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
'''

# Runs as another user: the whole client library over shm, as a worker would use it.
CHILD_CLIENT = r'''
import json, os, sys
import numpy as np
from smb_client import Client
req = json.load(sys.stdin)
with Client(req["controller"], os.environ["SMB_TOKEN"], transport="shm") as c:
    r = c.open_region(req["name"], mode="ro")
    print(json.dumps({"transports": sorted(set(r.transports().values())),
                      "data": r.read(0, 16, dtype="float32").tolist()}))
'''


def _as_other_user(script: str, request: dict, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(request), text=True,
                          capture_output=True, cwd=ROOT, timeout=60, user=OTHER_UID,
                          group=OTHER_GID, extra_groups=[], env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.get("uid", OTHER_UID) == OTHER_UID
    return out


@pytest.fixture
def shared_cluster():
    """A cluster whose shm sockets another user can reach (the directories on their path
    are 0755; pytest's own temporary directories are 0700), with file-backed extents."""
    workdir = tempfile.mkdtemp(prefix="smb-shm-security-")
    os.chmod(workdir, 0o755)
    try:
        with LocalCluster(servers=1, capacity="64M", workdir=workdir, persistent=True,
                          lease_seconds=30, log_level="INFO") as c:
            yield c
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _shm_path(cluster: LocalCluster) -> str:
    return str(cluster.workdir / "server-0" / "shm.sock")


def _request(client, name: str, mode: str, **extra) -> dict:
    info, ticket = client.open_info(name, mode)
    assert len(info.extents) == 1
    return {"ticket": ticket.token, "extent_id": info.extents[0].extent_id, **extra}


REFUSED_RO = ("reopen_rw", "shrink", "grow", "fallocate_grow", "seal_write", "seal_future_write",
              "chmod", "map_writable", "mprotect_writable", "madvise_remove")
REFUSED_RW = ("shrink", "grow", "fallocate_grow", "seal_write", "seal_future_write", "chmod")


@pytest.mark.parametrize("persistent", [False, True], ids=["memory", "file-backed"])
def test_another_user_cannot_reach_beyond_its_ticket(shared_cluster, persistent):
    cluster = shared_cluster
    path = _shm_path(cluster)
    with cluster.client(transport="tcp") as c:
        r = c.create_region("sec/r", 4 * MiB, placement="single", persistent=persistent)
        data = np.arange(MiB, dtype=np.float32)
        r.write(0, data)
        bystander = c.create_region("sec/other", MiB, placement="single", persistent=True)
        bystander.write(0, np.full(4, 7, np.int32))

        ro = _as_other_user(CHILD, {**_request(c, "sec/r", "ro"), "path": path})
        assert ro["writable"] is False
        assert ro["data"] == data[:4].tobytes().hex()            # it did get the extent
        assert {k: ro[k] for k in REFUSED_RO if ro[k] == "ok"} == {}, ro
        assert ro["size_after"] == 4096 + 4 * MiB

        rw = _as_other_user(CHILD, {**_request(c, "sec/r", "rw"), "path": path,
                                    "write": np.float32(42).tobytes().hex()})
        assert rw["writable"] is True and rw["wrote"] is True    # what the ticket allows works
        assert {k: rw[k] for k in REFUSED_RW if rw[k] == "ok"} == {}, rw
        assert rw["size_after"] == 4096 + 4 * MiB

        # the server is up and serves every region, with what the rw ticket wrote
        assert cluster.servers[0].poll() is None
        expect = data.copy()
        expect[0] = 42
        np.testing.assert_array_equal(r.read(dtype="float32"), expect)
        assert bystander.read(0, 16, dtype="int32").tolist() == [7] * 4
        c.delete_region("sec/r")
        c.delete_region("sec/other")


def test_socket_out_of_reach_is_a_typed_refusal(shared_cluster):
    cluster = shared_cluster
    locked = cluster.workdir / "locked"
    locked.mkdir(mode=0o700)
    os.symlink(_shm_path(cluster), locked / "shm.sock")
    with cluster.client(transport="tcp") as c:
        c.create_region("sec/locked", MiB, placement="single")
        out = _as_other_user(CHILD, {**_request(c, "sec/locked", "ro"), "path": _shm_path(cluster),
                                     "unreachable": str(locked / "shm.sock")})
        assert out["unreachable"].startswith("PermissionDenied: ")
        assert "transport='tcp'" in out["unreachable"]


def test_another_user_works_through_the_client_library(shared_cluster):
    cluster = shared_cluster
    with cluster.client(transport="tcp") as c:
        r = c.create_region("sec/lib", MiB, placement="single")
        r.write(0, np.arange(4, dtype=np.float32))
        out = _as_other_user(CHILD_CLIENT, {"controller": cluster.address, "name": "sec/lib"},
                             env={"SMB_TOKEN": cluster.token})
        assert out == {"transports": ["shm"], "data": [0.0, 1.0, 2.0, 3.0]}


def test_file_backed_data_written_through_shm_survives_a_restart(shared_cluster):
    cluster = shared_cluster
    with cluster.client(transport="shm") as c:
        r = c.create_region("sec/keep", 2 * MiB, placement="single", persistent=True)
        assert set(r.transports().values()) == {"shm"}
        data = np.arange(2 * MiB // 4, dtype=np.int32)
        r.write(0, data)                                      # straight into the memfd
        cluster.kill_server(0, signal.SIGTERM)               # written back on the way out
        assert cluster.servers[0].returncode == 0
        files = list((cluster.workdir / "server-0" / "data").glob("*.extent"))
        assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
        cluster.start_server(0)
        deadline = time.monotonic() + 20
        while {s.server_id: s.state for s in c.list_servers()}[cluster.server_id(0)] != "up":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        back = c.open_region("sec/keep")
        np.testing.assert_array_equal(back.read(dtype="int32"), data)


# Runs as another user: holds more connections to the shm socket than one user may
# keep, none of which presents a ticket, reports the answer its first one got (evicted
# for newer ones), and keeps the others until told to go.
CHILD_FLOOD = r'''
import json, socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)        # blocking: waits while the backlog is full
    held.append(s)
extra = held[0]
extra.settimeout(10)
answer = b""
while True:
    more = extra.recv(4096)
    if not more:
        break
    answer += more
status, length = struct.unpack_from("<BI", answer)
print(json.dumps({"status": status, "message": answer[5:5 + length].decode()}), flush=True)
sys.stdin.readline()
'''


def test_one_user_cannot_take_every_shm_connection(shared_cluster):
    from smb_protocol.errors import Status
    from smb_server.memserver.shm_plane import MAX_PER_USER

    cluster = shared_cluster
    with cluster.client(transport="shm") as c:
        r = c.create_region("sec/flood", MiB, placement="single")
        r.write(0, np.arange(4, dtype=np.int32))
        flood = subprocess.Popen([sys.executable, "-c", CHILD_FLOOD, _shm_path(cluster), str(MAX_PER_USER + 1)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 user=OTHER_UID, group=OTHER_GID, extra_groups=[])
        try:
            out = json.loads(flood.stdout.readline())
            assert out["status"] == Status.SERVER_BUSY
            assert "before it authenticated" in out["message"]
            assert "shm_connections_unauthenticated" in out["message"]     # names the knob
            # while that user floods the socket, this user's clients are served
            with cluster.client(transport="shm") as other:
                again = other.open_region("sec/flood")
                assert again.read(0, 16, dtype="int32").tolist() == [0, 1, 2, 3]
        finally:
            flood.communicate("\n", timeout=30)
        assert flood.returncode == 0


def test_a_full_backlog_delays_a_client_instead_of_failing_it(tmp_path):
    """While a socket's backlog is full (connections nobody accepted yet), a client's
    connect waits for room instead of failing at once with EAGAIN."""
    import socket
    import struct
    import threading

    from smb_client.transports.shm import fetch_extent_fd
    from smb_protocol.errors import ExtentNotFound, Status

    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    queued = []
    while True:                       # fill the backlog
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        queued.append(s)
    assert queued

    def serve_later() -> None:
        time.sleep(0.3)
        listener.settimeout(10)
        while True:
            conn, _ = listener.accept()
            head = conn.recv(4)
            if len(head) < 4:         # one of the fillers: it sent nothing
                conn.close()
                continue
            (n,) = struct.unpack("<I", head)
            while n + 8 > 0:
                n -= len(conn.recv(n + 8))
            message = b"no such extent"
            conn.sendall(struct.pack("<BI", Status.EXTENT_NOT_FOUND, len(message)) + message)
            conn.close()
            return

    server = threading.Thread(target=serve_later)
    server.start()
    try:
        for s in queued:
            s.shutdown(socket.SHUT_WR)    # the fillers say nothing and hang up once accepted
        with pytest.raises(ExtentNotFound, match="no such extent"):
            fetch_extent_fd(path, "ticket", 7, timeout=10)
    finally:
        server.join(20)
        for s in queued:
            s.close()
        listener.close()


def test_a_killed_server_keeps_what_was_written_back(tmp_path):
    """File-backed data written straight into the memfd (shm) reaches the file by the
    periodic write-back (``writeback_seconds``), so it survives kill -9."""
    with LocalCluster(servers=1, capacity="64M", workdir=str(tmp_path / "cluster"), persistent=True,
                      lease_seconds=30, env={"SMB_WRITEBACK_SECONDS": "0.2"}) as cluster:
        with cluster.client(transport="shm") as c:
            r = c.create_region("sec/crash", MiB, placement="single", persistent=True)
            data = np.arange(MiB // 4, dtype=np.int32) + 5
            r.write(0, data)
            path = cluster.workdir / "server-0" / "data" / f"{r.extents[0].extent_id}.extent"
            # the file changes twice after the write: the second write-back began after it
            deadline = time.monotonic() + 20
            for _ in range(2):
                seen = path.stat().st_mtime_ns
                while path.stat().st_mtime_ns == seen:
                    assert time.monotonic() < deadline, "never written back"
                    time.sleep(0.02)
            cluster.kill_server(0)                                # kill -9: no write-back on the way out
            cluster.start_server(0)
            deadline = time.monotonic() + 20
            while {s.server_id: s.state for s in c.list_servers()}[cluster.server_id(0)] != "up":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            np.testing.assert_array_equal(c.open_region("sec/crash").read(dtype="int32"), data)
