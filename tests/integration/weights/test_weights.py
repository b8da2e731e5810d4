"""Published weights on a real local cluster: publish and subscribe over tcp and shm
(every shard kind, bfloat16 on read, a server-side wait), versions kept and gone,
refusals with typed errors."""
from __future__ import annotations

import numpy as np
import pytest

from smb_client.weights import Publisher, Subscriber, columns
from smb_client.weights import subscriber as subscriber_module
from smb_protocol import errors

from .checks import check_publish_subscribe, consistent, empty, weights


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    return request.param


def test_publish_and_subscribe(cluster, name, transport):
    with cluster.client(transport="tcp") as trainer, cluster.client(transport=transport) as reader:
        check_publish_subscribe(trainer, reader, name)


def test_reads_go_over_the_clients_transport(cluster, name, transport):
    with cluster.client(transport="tcp") as trainer, cluster.client(transport=transport) as reader:
        pub = Publisher.create(trainer, name, weights(0))
        try:
            sub = Subscriber(reader, name)
            assert set(sub.data.transports().values()) == {transport}
            pub.publish(weights(0))
            assert consistent(sub.read().tensors, 0)
        finally:
            pub.delete()


def test_the_last_versions_are_kept_and_older_ones_are_gone(cluster, name):
    with cluster.client() as trainer, cluster.client() as reader:
        pub = Publisher.create(trainer, name, weights(0), versions=3)
        try:
            sub = Subscriber(reader, name)
            with pytest.raises(errors.NotFound):
                sub.read()
            for v in range(5):
                pub.publish(weights(v))
            for v in (3, 4):                       # K - 1 complete versions besides the one written next
                assert consistent(sub.read(empty(), version=v).tensors, v)
            with pytest.raises(errors.VersionGone):
                sub.read(version=1)
            with pytest.raises(errors.InvalidArgument):
                pub.publish(weights(4), version=4)     # not newer than the latest
        finally:
            pub.delete()


def test_a_buffer_reused_during_a_read_is_version_gone_or_read_again(cluster, name, monkeypatch):
    """The publisher laps the reader in the middle of its read (K publishes while its
    bytes travel): with retry the reader reads the newest, whole; without, VersionGone."""
    with cluster.client() as trainer, cluster.client() as reader:
        pub = Publisher.create(trainer, name, weights(0), versions=2)
        try:
            sub = Subscriber(reader, name)
            pub.publish(weights(0))
            real = subscriber_module.read_pieces
            laps = []

            def lapped(region, pieces, *args):
                n = real(region, pieces, *args)
                if not laps:                      # the first read is overwritten once it is done
                    laps.append(pub.publish(weights(pub.latest + 1)))
                    laps.append(pub.publish(weights(pub.latest + 1)))
                return n
            monkeypatch.setattr(subscriber_module, "read_pieces", lapped)
            snap = sub.read(empty())
            assert snap.version == 2 and consistent(snap.tensors, 2)
            laps.clear()
            with pytest.raises(errors.VersionGone):
                sub.read(empty(), retry=False)
            laps.clear()
            with pytest.raises(errors.VersionGone):
                sub.read(version=4)
        finally:
            pub.delete()


def test_bad_reads_and_publishes_are_refused(cluster, name):
    with cluster.client() as trainer, cluster.client() as reader:
        pub = Publisher.create(trainer, name, weights(0))
        try:
            sub = Subscriber(reader, name)
            pub.publish(weights(0))
            with pytest.raises(errors.InvalidArgument):
                sub.read({"a": np.zeros(5, np.float32)})             # the wrong size
            with pytest.raises(errors.DtypeError):
                sub.read({"b": np.zeros(1000, np.float32)})          # ints do not convert
            with pytest.raises(errors.InvalidArgument):
                sub.read(names=["nope"])
            with pytest.raises(errors.InvalidArgument):
                sub.read(names=["a"], shards={"b": columns(0, 2)})
            with pytest.raises(errors.InvalidArgument):
                pub.publish({"a": weights(1)["a"]})                   # a partial version
            with pytest.raises(errors.DtypeError):
                pub.publish({**weights(1), "b": np.zeros(1000, np.int32)})
            with pytest.raises(errors.RegionExists):
                Publisher.create(trainer, name, weights(0))
            again = Publisher.create(trainer, name, weights(0), exist_ok=True)
            assert again.latest == 0
            with pytest.raises(errors.RegionNotFound):
                Subscriber(reader, name + "-none")
            with pytest.raises(errors.Timeout):
                sub.wait(newer_than=0, timeout=0.2)
        finally:
            pub.delete()


def test_ranks_publish_one_version_together(cluster, name):
    """Two ranks write their own tensors; the version is complete (and woken on) only
    once the second finished."""
    with cluster.client() as c0, cluster.client() as c1, cluster.client() as reader:
        p0 = Publisher.create(c0, name, weights(0), ranks=2, rank=0)
        p1 = Publisher.open(c1, name, ranks=2, rank=1)
        try:
            sub = Subscriber(reader, name)
            for v in range(4):
                w = weights(v)
                p0.begin(v)
                p0.write({"a": w["a"], "b": w["b"]})
                assert not p0.finish()
                assert sub.latest() == (None if v == 0 else v - 1)
                p1.begin(v)
                p1.write({"c": w["c"], "check": w["check"]})
                assert p1.finish()
                assert consistent(sub.next(timeout=30).tensors, v)
        finally:
            p0.delete()
