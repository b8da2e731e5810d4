"""Published weights under faults, against real processes: a publisher racing the
readers as fast as it can (no read is ever torn; a reused buffer is caught), a publisher
killed with SIGKILL in the middle of a version (readers stay on the last complete one),
and a memory server killed with SIGKILL while replicated versions are read (nothing
lost, readers carry on)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from smb_client.weights import Publisher, Subscriber
from smb_protocol import errors

from .checks import consistent, empty, weights

RACE_SECONDS = 60.0       # at most; the race ends once enough of each outcome was seen


def start_publisher(cluster, name: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.weights._publisher", cluster.address,
                             cluster.token, name, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_no_read_is_torn_under_a_racing_publisher(cluster, name, transport):
    """Readers without retry: each read either holds one whole version (checksum and
    every element agree) or raised VersionGone; torn bytes are only ever seen in reads
    that raised. Readers with retry always get a whole version."""
    with cluster.client() as trainer, cluster.client(transport=transport) as reader:
        pub = Publisher.create(trainer, name, weights(0), versions=2)
        proc = start_publisher(cluster, name, "race")
        try:
            sub = Subscriber(reader, name)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "0"
            whole = gone = torn_caught = 0
            versions: set[int] = set()
            deadline = time.monotonic() + RACE_SECONDS
            while time.monotonic() < deadline and not (whole >= 30 and gone >= 1 and len(versions) >= 10):
                out = empty()
                try:
                    snap = sub.read(out, retry=False)
                except errors.VersionGone:
                    gone += 1
                    torn_caught += not consistent(out)
                    continue
                assert consistent(out, snap.version), f"torn read of version {snap.version}"
                versions.add(snap.version)
                whole += 1
                snap = sub.read(empty())                   # with retry: always whole
                assert consistent(snap.tensors, snap.version)
            assert proc.poll() is None, "the publisher died"
            assert whole >= 30 and len(versions) >= 10, (whole, versions)
            assert gone >= 1, f"the publisher never lapped a reader: {whole} whole reads"
            print(f"{whole} whole reads of {len(versions)} versions, {gone} VersionGone "
                  f"({torn_caught} of them held torn bytes)")
        finally:
            stop(proc)
            pub.delete()


def test_a_publisher_killed_mid_publish_leaves_readers_on_the_last_version(cluster, name):
    with cluster.client() as trainer, cluster.client() as reader:
        pub = Publisher.create(trainer, name, weights(0), versions=2)
        proc = start_publisher(cluster, name, "stall")
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "mid"
            sub = Subscriber(reader, name)
            proc.kill()                                      # kill -9 with version 2 half written
            proc.wait(30)
            assert sub.latest() == 1
            snap = sub.read(empty())
            assert snap.version == 1 and consistent(snap.tensors, 1)
            with pytest.raises(errors.Timeout):              # nothing newer is announced
                sub.wait(newer_than=1, timeout=0.3)
            again = Publisher.open(trainer, name)             # a restarted publisher goes on
            assert again.latest == 1
            again.publish(weights(2), 2)
            snap = sub.next(empty(), timeout=30)
            assert snap.version == 2 and consistent(snap.tensors, 2)
        finally:
            stop(proc)
            pub.delete()


def test_a_memory_server_killed_during_replicated_reads_loses_nothing(fresh_cluster, name):
    """replicas=2 over both servers: readers read in a loop while one server is killed
    with SIGKILL; no read fails or is torn, and the next version reaches them."""
    cluster = fresh_cluster
    with cluster.client() as trainer:
        pub = Publisher.create(trainer, name, weights(0), versions=2, replicas=2, stripe_unit=64 << 10)
        pub.publish(weights(0))
        readers = [cluster.client(transport=t) for t in ("tcp", "shm")]
        cond = threading.Condition()
        reads = [0, 0]
        failures: list[BaseException] = []
        stop_reading = threading.Event()

        def read_loop(k: int) -> None:
            try:
                sub = Subscriber(readers[k], name)
                while not stop_reading.is_set():
                    snap = sub.read(empty())
                    assert consistent(snap.tensors, snap.version), snap.version
                    with cond:
                        reads[k] += 1
                        cond.notify_all()
            except BaseException as exc:      # reported by the test
                failures.append(exc)
                with cond:
                    cond.notify_all()

        threads = [threading.Thread(target=read_loop, args=(k,)) for k in range(2)]
        try:
            for t in threads:
                t.start()
            with cond:
                assert cond.wait_for(lambda: min(reads) >= 5 or failures, 60)
                before = list(reads)
            cluster.kill_server(0)                           # kill -9 while both read
            with cond:
                assert cond.wait_for(lambda: min(r - b for r, b in zip(reads, before, strict=True)) >= 20
                                     or failures, 120)
            assert not failures, failures
            pub.publish(weights(1))                          # the publisher carries on too
            sub = Subscriber(readers[0], name)
            snap = sub.read(empty())
            assert snap.version == 1 and consistent(snap.tensors, 1)
        finally:
            stop_reading.set()
            for t in threads:
                t.join(60)
            for r in readers:
                r.close()
        assert not failures, failures
