"""All-reduce with a wire type: float32 buffers pushed as bfloat16 or float16, summed in
float32 by the memory servers, the sum back rounded once to the wire type or in full.

Each party is a client of its own in a thread of this process, against the shared local
cluster. Where the values and their sums are exact in every type involved the checks
are exact; random values are checked against the reference: the sum in float64 of the
pushes as the wire type holds them, rounded once.
"""
from __future__ import annotations

import numpy as np
import pytest

from smb_client.collective import Collective
from smb_protocol import errors
from smb_protocol.chunk_types import narrow, widen
from smb_protocol.dtypes import DType
from tests.integration.client.parties import run_parties

WIRES = {"bf16": DType.BFLOAT16, "fp16": DType.FLOAT16}


def _through(values: np.ndarray, wire: DType) -> np.ndarray:
    """``values`` (float32) as the wire type holds them, widened again."""
    raw = np.empty(len(values), np.uint16 if wire is DType.BFLOAT16 else np.float16)
    narrow(values.astype(np.float32), wire, raw)
    out = np.empty(len(values), np.float32)
    widen(raw, wire, out)
    return out


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("full_sum", [False, True])
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_small_integers_sum_exactly_in_every_mode(cluster, name, wire, full_sum, pipelined):
    n, parties = 10_000, 3

    def body(coll: Collective, rank: int) -> None:
        assert (coll.exchanger is not None) is pipelined
        for k in range(3):                       # both slots, one reused
            x = ((np.arange(n) % 20) * (rank + 1) + k).astype(np.float32)
            assert coll.all_reduce(x, wire=wire, full_sum=full_sum) is x
            expect = ((np.arange(n) % 20) * 6 + 3 * k).astype(np.float32)
            np.testing.assert_array_equal(x, expect)
    run_parties(cluster, name, parties, n * 4, 8192, "tcp", body, pipelined=pipelined)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_the_sum_is_kept_in_float32_and_rounded_once(cluster, name, wire):
    """Random gradients: the sum equals the float64 sum of the 16-bit pushes, rounded once
    (to float32, then to the wire type); a full sum is that float32 sum itself."""
    n, parties = 20_000, 4
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(n).astype(np.float32) * 10 ** rng.uniform(-3, 1) for _ in range(parties)]
    exact = np.sum([_through(g, WIRES[wire]).astype(np.float64) for g in grads], axis=0)
    got: dict[tuple[int, bool], np.ndarray] = {}

    def body(coll: Collective, rank: int) -> None:
        for full in (False, True):
            x = grads[rank].copy()
            coll.all_reduce(x, wire=wire, full_sum=full)
            got[rank, full] = x
    run_parties(cluster, name, parties, n * 4, 16384, "tcp", body)
    for rank in range(parties):
        np.testing.assert_array_equal(got[rank, False], got[0, False])   # every party the same bytes
        np.testing.assert_array_equal(got[rank, True], got[0, True])
    full = got[0, True].astype(np.float64)
    # float32 adds of (at most 4) 16-bit values: within a few float32 ulps of the exact sum
    assert np.all(np.abs(full - exact) <= 4 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) + 1e-30)
    # the 16-bit answer is the full sum rounded once to the wire type
    np.testing.assert_array_equal(got[0, False], _through(got[0, True], WIRES[wire]))


def test_a_wire_type_is_refused_where_it_cannot_carry_the_buffer(cluster, name):
    def body(coll: Collective, rank: int) -> None:
        with pytest.raises(errors.DtypeError, match="int64 chunks cannot travel as bfloat16"):
            coll.all_reduce(np.zeros(100, np.int64), wire="bf16")
        with pytest.raises(errors.DtypeError, match="travel as they are"):
            coll.all_reduce(np.zeros(100, np.float16), wire="bf16")
        with pytest.raises(errors.DtypeError, match="full sums"):
            coll.all_reduce(np.zeros(100, np.float32), full_sum=True)
        x = np.ones(100, np.float32)             # and the collective goes on
        coll.all_reduce(x, wire="bf16")
        np.testing.assert_array_equal(x, np.full(100, 2, np.float32))
    run_parties(cluster, name, 2, 400, 4096, "tcp", body)


def test_the_error_benchmark_runs_and_ranks_the_exchanges(tmp_path):
    """bench/wire_error.py, short: every exchange measured, float32 near exact, the
    full sum no worse than the rounded one, 16-bit far from float32."""
    import json

    from bench import wire_error
    out = tmp_path / "wire_error.json"
    assert wire_error.main(["--workers", "2", "--elements", "20000", "--out", str(out)]) == 0
    (point,) = json.loads(out.read_text())["points"]
    e = point["errors"]
    assert set(e) == {"collective float32", "collective bf16 wire", "collective bf16 wire, full sum",
                      "collective fp16 wire", "collective fp16 wire, full sum", "gloo bfloat16", "gloo float16",
                      "gloo float32"}
    assert e["collective float32"]["norm"] < 1e-6 and e["gloo float32"]["norm"] < 1e-6
    assert e["collective bf16 wire, full sum"]["norm"] <= e["collective bf16 wire"]["norm"]
    assert 1e-4 < e["collective bf16 wire"]["norm"] < 1e-2
