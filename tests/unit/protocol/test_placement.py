"""Property tests of the pure region layout (smb_protocol.placement)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb_protocol import errors
from smb_protocol.placement import Layout, Run, assign_segments, plan, plan_replicated, split_runs
from smb_protocol.units import format_bytes

settings.register_profile("smb", max_examples=150, deadline=None)
settings.load_profile("smb")


@st.composite
def striped_layouts(draw: st.DrawFn) -> Layout:
    unit = draw(st.integers(1, 4096))
    size = draw(st.integers(1, unit * 64))
    k = draw(st.integers(1, 9))
    return Layout.striped(size, unit, k)


@st.composite
def layered_layouts(draw: st.DrawFn) -> Layout:
    sizes = draw(st.lists(st.integers(1, 5000), min_size=1, max_size=24))
    k = draw(st.integers(1, 9))
    return Layout.layered(sizes, assign_segments(sizes, k))


layouts = st.one_of(striped_layouts(), layered_layouts(),
                    st.integers(1, 100_000).map(Layout.single))


@st.composite
def layout_and_range(draw: st.DrawFn) -> tuple[Layout, int, int]:
    layout = draw(layouts)
    offset = draw(st.integers(0, layout.size))
    length = draw(st.integers(0, layout.size - offset))
    return layout, offset, length


@given(layout_and_range())
def test_pieces_cover_the_range_exactly_in_order(case: tuple[Layout, int, int]) -> None:
    layout, offset, length = case
    pieces = layout.map(offset, length)
    pos = offset
    for p in pieces:
        assert p.length > 0
        assert p.region_offset == pos
        assert 0 <= p.extent < len(layout.extent_lengths)
        assert 0 <= p.extent_offset
        assert p.extent_offset + p.length <= layout.extent_lengths[p.extent]
        pos += p.length
    assert pos == offset + length


@given(layouts)
def test_region_bytes_fill_extents_without_overlap(layout: Layout) -> None:
    """Over the whole region: no two region bytes share an extent byte, and every
    extent byte is used (extents are sized exactly)."""
    per_extent: dict[int, list[tuple[int, int]]] = {}
    for p in layout.map(0, layout.size):
        per_extent.setdefault(p.extent, []).append((p.extent_offset, p.extent_offset + p.length))
    assert sorted(per_extent) == list(range(len(layout.extent_lengths)))
    for extent, spans in per_extent.items():
        spans.sort()
        end = 0
        for start, stop in spans:
            assert start >= end, f"overlap on extent {extent}"
            end = stop
        assert sum(b - a for a, b in spans) == layout.extent_lengths[extent]
    assert sum(layout.extent_lengths) == layout.size


@given(layout_and_range())
def test_runs_are_contiguous_on_their_extent_and_merge_fully(case: tuple[Layout, int, int]) -> None:
    layout, offset, length = case
    runs = layout.runs(offset, length)
    covered = []
    last_end: dict[int, int] = {}
    for run in runs:
        assert sum(n for _, n in run.parts) == run.length
        assert run.extent_offset + run.length <= layout.extent_lengths[run.extent]
        # a run never continues the previous run of the same extent (it would have merged)
        assert last_end.get(run.extent) != run.extent_offset
        last_end[run.extent] = run.extent_offset + run.length
        at = run.extent_offset
        for region_offset, n in run.parts:
            for p in layout.map(region_offset, n):
                assert (p.extent, p.extent_offset) == (run.extent, at)
                at += p.length
            covered.append((region_offset, n))
    covered.sort()
    pos = offset
    for region_offset, n in covered:
        assert region_offset == pos
        pos += n
    assert pos == offset + length


@given(layouts)
def test_whole_region_is_one_run_per_extent(layout: Layout) -> None:
    assert len(layout.runs(0, layout.size)) == len(layout.extent_lengths)


@given(striped_layouts())
def test_striped_extents_balanced_within_one_stripe_unit(layout: Layout) -> None:
    assert max(layout.extent_lengths) - min(layout.extent_lengths) <= layout.stripe_unit


@given(layered_layouts())
def test_layered_segments_whole_on_one_extent(layout: Layout) -> None:
    for start, size, extent in zip(layout.segment_offsets(), layout.segment_sizes,
                                   layout.segment_extents, strict=True):
        pieces = layout.map(start, size)
        assert len(pieces) == 1
        assert pieces[0].extent == extent


@given(layouts, st.integers(1, 100), st.integers(0, 100))
def test_out_of_range_raises(layout: Layout, extra: int, offset: int) -> None:
    with pytest.raises(errors.OutOfRange):
        layout.map(min(offset, layout.size), layout.size - min(offset, layout.size) + extra)


@given(st.integers(1, 1 << 24), st.sampled_from(["striped", "layered", "single"]),
       st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 1 << 24), min_size=1),
       st.integers(1, 1 << 20))
def test_plan_fits_or_raises_out_of_memory(size: int, placement: str, free: dict[str, int],
                                           unit: int) -> None:
    try:
        layout, servers = plan(size, placement, free, stripe_unit=unit)
    except errors.OutOfMemory as exc:
        assert format_bytes(size) in str(exc) and "free" in str(exc)   # sizes readable
        return
    assert layout.size == size
    assert len(servers) == len(layout.extent_lengths) == len(set(servers))
    for length, server in zip(layout.extent_lengths, servers, strict=True):
        assert length <= free[server]


def test_plan_out_of_memory_names_the_numbers() -> None:
    with pytest.raises(errors.OutOfMemory) as info:
        plan(1000, "single", {"a": 600, "b": 500})
    text = str(info.value)
    assert "1000" in text and "600" in text and "a" in text
    with pytest.raises(errors.OutOfMemory, match="no memory server"):
        plan(10, "striped", {})
    with pytest.raises(errors.OutOfMemory, match="3 servers asked for"):
        plan(10, "striped", {"a": 100}, num_servers=3)


def test_plan_spreads_stripes_and_validates() -> None:
    layout, servers = plan(8 << 20, "striped", {"a": 1 << 30, "b": 1 << 30}, stripe_unit=1 << 20)
    assert layout.extent_lengths == (4 << 20, 4 << 20) and sorted(servers) == ["a", "b"]
    with pytest.raises(errors.InvalidArgument, match="unknown placement"):
        plan(10, "diagonal", {"a": 100})
    with pytest.raises(errors.InvalidArgument, match="add up"):
        plan(10, "layered", {"a": 100}, segment_sizes=[3, 3])


@given(layouts, st.data(), st.integers(1, 5000), st.sampled_from([1, 2, 4, 8]))
def test_split_runs_covers_the_range_in_order_within_chunk(layout, data, chunk, align):
    offset = data.draw(st.integers(0, layout.size - 1))
    length = data.draw(st.integers(0, layout.size - offset))
    runs = layout.runs(offset, length)
    split = split_runs(runs, chunk, align)
    limit = max(align, chunk - chunk % align)
    assert all(0 < r.length <= limit for r in split)
    assert sum(r.length for r in split) == length
    for r in split:   # each run is contiguous on its extent and its parts add up
        assert sum(n for _, n in r.parts) == r.length
    # the byte-by-byte mapping is the one of the unsplit runs
    def bytes_of(rs):
        out = []
        for r in rs:
            eo = r.extent_offset
            for ro, n in r.parts:
                out.extend((ro + i, r.extent, eo + i) for i in range(n))
                eo += n
        return sorted(out)
    if length <= 4096:
        assert bytes_of(split) == bytes_of(runs)


def test_split_runs_keeps_alignment():
    run = Run(0, 8, 40, [(100, 12), (200, 28)])
    split = split_runs([run], 10, 4)
    assert [(r.extent_offset, r.length) for r in split] == [(8, 8), (16, 8), (24, 8), (32, 8), (40, 8)]
    assert split[1].parts == [(108, 4), (200, 4)]


@pytest.mark.parametrize("chunk,align", [(0, 1), (8, 0), (-1, 4)])
def test_split_runs_bad_arguments(chunk, align):
    with pytest.raises(errors.InvalidArgument):
        split_runs([], chunk, align)


# -- replicated placement ----------------------------------------------------------------
@st.composite
def clusters(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, str]]:
    n = draw(st.integers(1, 8))
    hosts = draw(st.integers(1, n))
    free = {f"s{i}": draw(st.integers(0, 1 << 16)) for i in range(n)}
    return free, {f"s{i}": f"h{draw(st.integers(0, hosts - 1))}" for i in range(n)}


@given(clusters(), st.integers(1, 3), st.integers(1, 1 << 16), st.sampled_from(["striped", "layered", "single"]),
       st.integers(0, 4))
def test_replicated_plans_keep_copies_apart_and_fit(cluster, replicas, size, placement, num_servers):
    free, hosts = cluster
    num_servers = min(num_servers, len(free))
    kw = {"stripe_unit": 4096, "num_servers": num_servers}
    try:
        layout, copies = plan_replicated(size, placement, free, replicas, hosts, **kw)
    except errors.OutOfMemory as exc:
        assert "free" in str(exc) or replicas > len(free)     # says why, with the sizes
        return
    assert replicas <= len(free)
    primaries_only, servers = plan(size, placement, free, **kw)
    assert layout == primaries_only and [c[0] for c in copies] == servers   # primaries as plan's
    distinct_hosts = len({hosts[s] for s in free})
    used: dict[str, int] = {}
    for length, sids in zip(layout.extent_lengths, copies, strict=True):
        assert len(sids) == replicas and len(set(sids)) == replicas            # distinct servers
        if all(free[s] >= size * replicas for s in free):                        # room everywhere:
            assert len({hosts[s] for s in sids}) == min(replicas, distinct_hosts)  # hosts apart
        for s in sids:
            used[s] = used.get(s, 0) + length
    assert all(used[s] <= free[s] for s in used)                               # fits


def test_replicated_plan_prefers_other_hosts_and_balances_primaries():
    free = {"a": 100, "b": 100, "c": 100, "d": 100}
    hosts = {"a": "h1", "b": "h1", "c": "h2", "d": "h2"}
    layout, copies = plan_replicated(200, "striped", free, 2, hosts, stripe_unit=50)
    assert sorted(c[0] for c in copies) == ["a", "b", "c", "d"]             # one primary each
    for sids in copies:
        assert hosts[sids[0]] != hosts[sids[1]]                            # the other host
    assert sorted(s for c in copies for s in c[1:]) == ["a", "b", "c", "d"]  # backups balanced too


def test_replicated_plan_errors_have_numbers():
    with pytest.raises(errors.InvalidArgument, match="replicas must be 1 to 3"):
        plan_replicated(10, "single", {"a": 100}, 4)
    with pytest.raises(errors.OutOfMemory, match="2 copies of every byte need 2 memory servers, only 1"):
        plan_replicated(10, "single", {"a": 100}, 2)
    with pytest.raises(errors.OutOfMemory, match="a copy of 60 B finds at most 50 B"):
        plan_replicated(60, "single", {"a": 100, "b": 50}, 2)
    # hosts unknown: distinct servers still
    _, copies = plan_replicated(60, "single", {"a": 100, "b": 100, "c": 100}, 3)
    assert sorted(copies[0]) == ["a", "b", "c"]


# -- weighted layered placement and the share math ---------------------------------
from smb_protocol.placement import assign_weighted, check_weights, chunk_shares, host_loads  # noqa: E402  (grouped with the tests that use them)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40),
       st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=8).filter(lambda w: any(w)))
def test_assign_weighted_gives_each_server_about_its_share(sizes, weights):
    chosen = assign_weighted(sizes, weights)
    load = [0] * len(weights)
    for s, j in zip(sizes, chosen, strict=True):
        load[j] += s
    total, w_total, live = sum(sizes), sum(weights), sum(1 for w in weights if w > 0)
    for j, w in enumerate(weights):
        if w == 0:
            assert load[j] == 0
        assert load[j] <= w / w_total * (total + live * max(sizes)) + 1e-6


@given(st.dictionaries(st.text(min_size=1, max_size=12), st.floats(0, 1e6, allow_nan=False),
                       min_size=1, max_size=6).filter(lambda w: any(w.values())))
def test_check_weights_keeps_good_weights(weights):
    assert check_weights(weights) == {k: float(v) for k, v in weights.items()}


@pytest.mark.parametrize("bad", [{}, {"a": -1}, {"a": 0}, {"a": float("inf")}, {"a": True}, {"": 1}, [("a", 1)]])
def test_check_weights_refuses_bad_weights(bad):
    with pytest.raises(errors.InvalidArgument):
        check_weights(bad)


def test_plan_weighted_puts_segments_on_the_named_servers_in_proportion():
    free = {"a": 1 << 30, "b": 1 << 30, "c": 1 << 30, "d": 1 << 30}
    layout, servers = plan(25 * 100, "layered", free, segment_sizes=[100] * 25,
                           weights={"a": 2, "b": 2, "c": 1, "d": 0})
    got = dict(zip(servers, layout.extent_lengths, strict=True))
    assert got == {"a": 1000, "b": 1000, "c": 500}
    with pytest.raises(errors.OutOfMemory, match="not up"):
        plan(100, "layered", free, segment_sizes=[100], weights={"x": 1})
    with pytest.raises(errors.InvalidArgument, match="exclude"):
        plan(100, "layered", free, segment_sizes=[100], num_servers=1, weights={"a": 1})
    with pytest.raises(errors.OutOfMemory, match="needs 200 B,"):
        plan(200, "layered", {"a": 100}, segment_sizes=[200], weights={"a": 1})
    with pytest.raises(errors.InvalidArgument, match="layered"):
        plan(200, "striped", free, weights={"a": 1})
    layout, copies = plan_replicated(400, "layered", free, 2, segment_sizes=[100] * 4,
                                     weights={"a": 1, "b": 1})
    assert [c[0] for c in copies] == ["a", "b"] and all(len(set(c)) == 2 for c in copies)


def _max_time(shares, servers, workers, links=None):
    links = links or {}
    return max(load / links.get(h, 1.0) for h, load in host_loads(shares, servers, workers).items())


def test_chunk_shares_dedicated_servers_split_evenly():
    servers = {f"s{j}": f"srv{j}" for j in range(4)}
    shares = chunk_shares(servers, [f"w{i}" for i in range(4)])
    assert shares == pytest.approx({s: 0.25 for s in servers})
    assert _max_time(shares, servers, [f"w{i}" for i in range(4)]) == pytest.approx(1.0)


def test_chunk_shares_mixed_gives_colocated_servers_less():
    # 4 workers; two servers on workers' hosts, two on hosts of their own
    servers = {"c0": "h0", "c1": "h1", "d0": "x0", "d1": "x1"}
    workers = ["h0", "h1", "h2", "h3"]
    shares = chunk_shares(servers, workers)
    assert shares == pytest.approx({"c0": 1 / 6, "c1": 1 / 6, "d0": 1 / 3, "d1": 1 / 3})
    assert _max_time(shares, servers, workers) == pytest.approx(4 / 3)   # even shares: 1.5 (the ring's)
    assert _max_time({s: 0.25 for s in servers}, servers, workers) == pytest.approx(1.5)


@pytest.mark.parametrize("n,k", [(4, 4), (8, 4), (8, 8), (3, 1), (16, 2)])
def test_chunk_shares_reproduce_the_byteps_speedup(n, k):
    """A server beside every worker plus k on hosts of their own: the busiest link
    carries 2(n-1)/n / ((n^2+kn-2k)/n^2) of the gradient (BytePS's speedup over the ring)."""
    servers = {f"c{i}": f"h{i}" for i in range(n)} | {f"d{j}": f"x{j}" for j in range(k)}
    workers = [f"h{i}" for i in range(n)]
    t = _max_time(chunk_shares(servers, workers), servers, workers)
    assert (2 * (n - 1) / n) / t == pytest.approx((n * n + k * n - 2 * k) / (n * n))


@given(st.integers(1, 9), st.integers(0, 6), st.integers(0, 6), st.integers(0, 4), st.data())
def test_chunk_shares_are_optimal(n, colocated, dedicated, extra_on_one, data):
    """Shares add up to 1, and no other split loads the busiest link less (random
    splits and every single-server one)."""
    colocated = min(colocated, n)
    if colocated + dedicated + extra_on_one == 0:
        dedicated = 1
    servers = {f"c{i}": f"h{i}" for i in range(colocated)} | {f"d{j}": f"x{j}" for j in range(dedicated)}
    servers |= {f"e{j}": "h0" if colocated else "x0" for j in range(extra_on_one)}
    workers = [f"h{i}" for i in range(n)]
    links = {h: data.draw(st.sampled_from([0.5, 1.0, 2.0])) for h in {*servers.values(), *workers}}
    shares = chunk_shares(servers, workers, links)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(x >= 0 for x in shares.values())
    best = _max_time(shares, servers, workers, links)
    ids = sorted(servers)
    for sid in ids:
        assert best <= _max_time({s: float(s == sid) for s in ids}, servers, workers, links) + 1e-9
    raw = data.draw(st.lists(st.floats(0, 1), min_size=len(ids), max_size=len(ids)).filter(lambda r: sum(r) > 0))
    other = {s: r / sum(raw) for s, r in zip(ids, raw, strict=True)}
    assert best <= _max_time(other, servers, workers, links) + 1e-9


def test_chunk_shares_refuses_nonsense():
    with pytest.raises(errors.InvalidArgument):
        chunk_shares({}, ["h"])
    with pytest.raises(errors.InvalidArgument):
        chunk_shares({"s": "h"}, [])
    with pytest.raises(errors.InvalidArgument):
        chunk_shares({"s": "h"}, ["h"], {"h": 0})
