"""Every data-plane operation against a real local cluster, over tcp and shm (and over
rdma in tests/rdma, which imports these; torch's own tests are in test_dataplane_torch.py,
which the rdma tier leaves out: torch's tensors reach every transport as the same views
of their memory, and importing torch takes minutes in the VM's emulated CPUs)."""
from __future__ import annotations

import numpy as np
import pytest

from smb_protocol import errors
from smb_protocol.dtypes import bf16_to_f32, f32_to_bf16

MiB = 1 << 20


def test_transport_is_the_one_asked_for(tclient, name):
    r = tclient.create_region(name, 4 * MiB)
    assert set(r.transports().values()) == {tclient.transport}
    tclient.delete_region(name)


@pytest.mark.parametrize("placement", ["striped", "layered", "single"])
def test_write_read_roundtrip(tclient, name, placement):
    size = 5 * MiB + 12345
    kw = {"segment_sizes": [3 * MiB, MiB + 12345, MiB]} if placement == "layered" else {}
    r = tclient.create_region(name, size, placement=placement, stripe_unit=256 << 10, **kw)
    assert sum(e.length for e in r.extents) == size
    if placement != "single":
        assert len({e.server_id for e in r.extents}) == 2
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    r.write(0, data)
    assert bytes(r.read()) == data.tobytes()
    # unaligned pieces that cross stripe and segment boundaries
    for off, n in [(1, 7), (256 << 10, 1), (3 * MiB - 5, 10), (size - 3, 3), (100, 3 * MiB)]:
        assert bytes(r.read(off, n)) == data[off:off + n].tobytes()
    patch = bytes(range(200)) * 50
    r.write(3 * MiB - 100, patch)
    data[3 * MiB - 100:3 * MiB - 100 + len(patch)] = np.frombuffer(patch, np.uint8)
    out = np.empty(size, np.uint8)
    r.read_into(0, out)
    assert np.array_equal(out, data)
    r.close()
    tclient.delete_region(name)


DTYPES = ["float32", "float16", "float64", "int32", "int64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_every_dtype(tclient, name, dtype):
    n = 300_000  # spans several stripes of both servers
    r = tclient.create_region(name, n * 8, stripe_unit=64 << 10)
    rng = np.random.default_rng(2)
    if dtype.startswith("int"):
        a = rng.integers(-1000, 1000, n).astype(dtype)
        b = rng.integers(-1000, 1000, n).astype(dtype)
    else:
        a = rng.standard_normal(n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
    r.write(0, a)
    r.accumulate(0, b)
    got = r.read(0, a.nbytes, dtype=dtype)
    np.testing.assert_array_equal(got, a + b)
    tclient.delete_region(name)


def test_accumulate_bfloat16(tclient, name):
    """bfloat16 adds, each rounded once to nearest-even from its float32 sum (the
    helpers are checked against torch in test_dataplane_torch.py)."""
    n = 100_000
    r = tclient.create_region(name, n * 2, stripe_unit=32 << 10)
    rng = np.random.default_rng(3)
    a = f32_to_bf16(rng.standard_normal(n, dtype=np.float32))
    b = f32_to_bf16(rng.standard_normal(n, dtype=np.float32))
    r.write(0, a)
    r.accumulate(0, b, dtype="bfloat16")
    got = r.read(0, a.nbytes, dtype="bfloat16")
    np.testing.assert_array_equal(got, f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)))
    tclient.delete_region(name)


def test_scale_and_axpy(tclient, name):
    n = 200_000
    r = tclient.create_region(name, n * 4, stripe_unit=64 << 10)
    a = np.linspace(-5, 5, n, dtype=np.float32)
    x = np.linspace(1, 2, n, dtype=np.float32)
    r.write(0, a)
    r.scale(0, a.nbytes, 0.5, "float32")
    r.axpy(0, x, -2.0)                   # axpy(offset, x, alpha): the data follows the offset
    np.testing.assert_allclose(r.read(dtype="float32"), a * np.float32(0.5) + np.float32(-2.0) * x, rtol=1e-6)
    # a sub-range only
    r.scale(400, 40, 10.0, "float32")
    expect = a * np.float32(0.5) + np.float32(-2.0) * x
    expect[100:110] *= 10
    np.testing.assert_allclose(r.read(dtype="float32"), expect, rtol=1e-6)
    tclient.delete_region(name)


def test_atomics(tclient, name):
    r = tclient.create_region(name, MiB, stripe_unit=64 << 10)
    assert r.fetch_add(0, 5) == 0
    assert r.fetch_add(0, -2) == 5
    assert r.read(0, 8, dtype="int64")[0] == 3
    assert r.compare_swap(64 << 10, 0, 42) == 0      # second server's first word
    assert r.compare_swap(64 << 10, 0, 7) == 42      # no swap: value was not 0
    assert r.read(64 << 10, 8, dtype="int64")[0] == 42
    with pytest.raises(errors.Misaligned):
        r.fetch_add(4, 1)
    tclient.delete_region(name)


def test_fetch_add_many(tclient, name):
    unit = 64 << 10
    r = tclient.create_region(name, MiB, stripe_unit=unit)
    # words on both servers, one of them hit three times in the batch, and more words
    # than one queue pair keeps in flight
    items = [(0, 1), (unit, 10), (0, 2), (unit + 8, -5), (0, 3)] + [(2 * unit + 8 * k, k) for k in range(300)]
    olds = r.fetch_add_many(items)
    assert olds[:5] == [0, 0, 1, 0, 3]                 # in order, each add sees the ones before
    assert olds[5:] == [0] * 300
    words = r.read(0, MiB, dtype="int64")
    assert words[0] == 6 and words[unit // 8] == 10 and words[unit // 8 + 1] == -5
    assert list(words[2 * unit // 8:2 * unit // 8 + 300]) == list(range(300))
    assert r.fetch_add_many([]) == []
    # a bad word anywhere refuses the whole batch before anything is added
    for bad, error in [((12, 1), errors.Misaligned), ((MiB, 1), errors.OutOfRange)]:
        with pytest.raises(error):
            r.fetch_add_many([(0, 100), bad])
    assert r.read(0, 8, dtype="int64")[0] == 6
    ro = tclient.open_region(name, mode="ro")
    with pytest.raises(errors.ReadOnly):
        ro.fetch_add_many([(0, 1)])
    ro.close()
    tclient.delete_region(name)


def test_async_and_batched_forms(tclient, name):
    r = tclient.create_region(name, 8 * MiB, stripe_unit=MiB)
    chunks = [np.full(MiB // 4, i, np.float32) for i in range(8)]
    futs = [r.write_async(i * MiB, c) for i, c in enumerate(chunks)]
    for f in futs:
        f.result(timeout=30)
    r.accumulate_many([(i * MiB, c) for i, c in enumerate(chunks)])
    outs = [np.empty(MiB // 4, np.float32) for _ in range(8)]
    got = r.read_many([(i * MiB, o) for i, o in enumerate(outs)])
    assert len(got) == 8 and all(g is o for g, o in zip(got, outs, strict=True))   # the buffers, in order
    for i, o in enumerate(outs):
        assert np.all(o == 2 * i)
    again = r.read_many_async([(i * MiB + 4, np.empty(2, np.float32)) for i in range(8)]).result(timeout=30)
    assert [float(a[0]) for a in again] == [2.0 * i for i in range(8)]
    assert r.fetch_add_async(0, 1).result(timeout=30) == 0
    word = 7 * MiB + 64
    before = int(r.read(word, 8, dtype="int64")[0])
    assert r.fetch_add_many_async([(word, 3), (word, 4)]).result(timeout=30) == [before, before + 3]
    assert r.read(word, 8, dtype="int64")[0] == before + 7
    r.write(word, np.full(2, 14, np.float32))
    whole = r.read_async(0, 8 * MiB, dtype="float32").result(timeout=30)
    assert whole[1] == 0 and whole[-1] == 14
    tclient.delete_region(name)


def test_open_by_name_sees_same_memory(cluster, tclient, name):
    r = tclient.create_region(name, 2 * MiB)
    r.write(0, b"hello from the master")
    with cluster.client() as other:
        r2 = other.open_region(name)
        assert bytes(r2.read(0, 21)) == b"hello from the master"
        r2.write(MiB + 3, b"worker")
        r2.close()
    assert bytes(r.read(MiB + 3, 6)) == b"worker"
    tclient.delete_region(name)


AT_EXIT = """
import atexit, sys
import numpy as np
import smb_client

client = smb_client.Client(sys.argv[1], sys.argv[2], transport=sys.argv[4])
region = client.create_region(sys.argv[3], 1 << 20, stripe_unit=1 << 16, num_servers=2)

def at_exit():   # runs after threading shut the executors down
    data = np.arange(1 << 17, dtype=np.int64)
    region.write(0, data)                                    # many requests, both servers
    ok = np.array_equal(region.read(0, 1 << 20, dtype=np.int64), data)
    region.write_async(0, data[:8]).result()
    client.delete_region(sys.argv[3])
    client.close()
    print("at exit:", "ok" if ok else "wrong")
atexit.register(at_exit)
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_client_works_in_an_atexit_handler(cluster, client, name, transport, tmp_path):
    import subprocess
    import sys
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    proc = subprocess.run([sys.executable, str(script), cluster.address, cluster.token, name, transport],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "at exit: ok" in proc.stdout, proc.stderr[-3000:]
    assert client.list_regions(name) == []
