"""Where a step's time goes: the memory-box waits of SyncDataParallel and SEASGD are
named ranges in a torch.profiler trace of an unchanged training loop, and each step's
seconds by phase are kept, logged and written to a TensorBoard-style writer (worker
threads on a real local cluster)."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from smb_client.torch import SEASGD, ParameterStore, SyncDataParallel  # noqa: E402
from smb_client.torch.steps import PHASES, StepTimes  # noqa: E402
from tests.integration.torch.ranks import run_on_one_store  # noqa: E402

WORLD = 2
STEPS = 4


class Scalars:
    """What a SummaryWriter is given: (tag, value, step) in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.got.append((tag, float(value), step))


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def train(dp_step, model: torch.nn.Module, opt, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(4, 8, generator=g)),
                                          torch.randint(0, 4, (4,), generator=g)).backward()
        dp_step()
        opt.step()


def names(prof) -> set[str]:
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("exchange", ["collective", "slots"])
def test_a_sync_step_shows_its_waits_in_a_profiler_trace_and_in_its_times(cluster, name, exchange, caplog):
    models = [make_model() for _ in range(WORLD)]
    writer = Scalars()
    seen: dict[int, set[str]] = {}
    times: dict[int, StepTimes] = {}
    caplog.set_level(logging.INFO, logger="smb_client.torch.steps")

    def worker(rank: int, c, store) -> None:
        dp = SyncDataParallel(store, rank, WORLD, exchange=exchange, check_env=False,
                              log_every=2 if rank == 0 else 0, writer=writer if rank == 0 else None)
        opt = torch.optim.SGD(models[rank].parameters(), lr=0.1)
        if rank == 0:    # one profiler per process
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train(dp.synchronize, models[rank], opt, rank)
            seen[rank] = names(prof)
        else:
            train(dp.synchronize, models[rank], opt, rank)
        times[rank] = dp.times
        dp.close()

    run_on_one_store(cluster, name, models, worker, grad_slots=3, workers=WORLD)
    assert {"smb::sync.push", "smb::sync.sum"} <= seen[0], sorted(n for n in seen[0] if "smb" in n)
    if exchange == "slots":
        assert "smb::sync.barrier" in seen[0]
    for rank in range(WORLD):
        t = times[rank]
        assert t.steps == STEPS and set(t.last) == set(PHASES)
        assert t.total["sum"] > 0 and all(v >= 0 for v in t.total.values())
        assert t.mean()["sum"] == pytest.approx(t.total["sum"] / STEPS)
    # every step's phases to the writer, under smb/sync/<phase>_seconds, steps 1..STEPS
    assert [s for _, _, s in writer.got] == [s for s in range(1, STEPS + 1) for _ in PHASES]
    assert {tag for tag, _, _ in writer.got} == {f"smb/sync/{p}_seconds" for p in PHASES}
    logged = [r.getMessage() for r in caplog.records if r.name == "smb_client.torch.steps"]
    assert len(logged) == STEPS // 2 and logged[0].startswith("sync steps 1-2, mean seconds: compute ")


def test_seasgd_shows_its_updates_in_a_profiler_trace(cluster, name):
    model = make_model()
    with cluster.client() as c:
        store = ParameterStore.create(c, name, model, workers=1, delta_slots=1)
        try:
            worker = SEASGD(store, 0, 1, update_interval=2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train(worker.after_step, model, opt, 0)
            worker.close()
        finally:
            store.destroy()
    assert {"smb::seasgd.push", "smb::seasgd.sum"} <= names(prof)
    assert worker.times.steps == STEPS and worker.updates == STEPS // 2
    assert worker.times.total["sum"] > 0


class Clock:
    """A ``time`` stand-in whose ``perf_counter`` moves only when told to (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_nested_phase_is_counted_once(monkeypatch):
    """A wait inside another wait adds its seconds to the outer phase only: the phases
    of a step add up to its wall time."""
    from smb_client.torch import steps
    clock = Clock()
    monkeypatch.setattr(steps, "time", clock)
    t = StepTimes("x")
    clock.advance(1.0)                       # computing
    with t.phase("push"):
        clock.advance(2.0)
        with t.phase("push"):                # the same phase, nested
            clock.advance(4.0)
        with t.phase("sum"):                 # another phase, nested
            clock.advance(8.0)
    t.add("barrier", 0.5)                    # timed elsewhere: added as it is
    clock.advance(0.5)
    t.end_step()
    assert t.last == {"compute": 1.0, "push": 14.0, "sum": 0.0, "barrier": 0.5}
    assert sum(t.last.values()) == 15.5      # the step's wall time, nothing twice


def known_clock(monkeypatch) -> Clock:
    """A Clock that the step timers and SEASGD read in place of ``time``."""
    from smb_client.torch import seasgd as seasgd_module
    from smb_client.torch import steps
    clock = Clock()
    monkeypatch.setattr(steps, "time", clock)
    monkeypatch.setattr(seasgd_module, "time", clock)
    return clock


# a SEASGD worker's phases, step by step, of 1 s computing a step and waits made 5 s
# (push) and 3 s (read) long by seasgd_clock: with update_interval=2, every second step updates
SEASGD_STEPS = [{"compute": 1.0, "push": 0.0, "sum": 0.0, "barrier": 0.0},
                {"compute": 1.0, "push": 5.0, "sum": 3.0, "barrier": 0.0}] * (STEPS // 2)


def seasgd_clock(monkeypatch, worker, clock: Clock, push: float, read: float) -> None:
    """Make ``worker``'s waits take ``push`` and ``read`` seconds of ``clock``."""
    wait_push, pull = worker._wait_push, worker.store.pull_params

    def slow_wait_push() -> None:
        clock.advance(push)
        wait_push()

    def slow_pull(*args, **kwargs):
        clock.advance(read)
        return pull(*args, **kwargs)
    monkeypatch.setattr(worker, "_wait_push", slow_wait_push)
    monkeypatch.setattr(worker.store, "pull_params", slow_pull)


def test_seasgd_counts_each_wait_once(cluster, name, monkeypatch):
    """Under a clock that moves only by known amounts (1 s computing per step, 5 s
    waiting for the last push, 3 s reading the global weights), every step's phases
    are exactly those: no interval lands in two phases or twice in one, and over all
    steps they add up to the wall time."""
    clock = known_clock(monkeypatch)
    start = clock.now
    model = make_model()
    with cluster.client() as c:
        store = ParameterStore.create(c, name, model, workers=1, delta_slots=1)
        try:
            worker = SEASGD(store, 0, 1, update_interval=2)
            seasgd_clock(monkeypatch, worker, clock, push=5.0, read=3.0)
            lasts = []
            for _ in range(STEPS):
                clock.advance(1.0)           # the step's forward, backward and optimizer
                worker.after_step()
                lasts.append(dict(worker.times.last))
            worker.close()
        finally:
            store.destroy()
    assert lasts == SEASGD_STEPS
    assert sum(worker.times.total.values()) == clock.now - start - 5.0   # close()'s wait is no step's
    assert (worker.push_wait, worker.read_wait) == (5.0 * 3, 3.0 * 2)    # close() waited once more


def test_hybrid_counts_its_leaders_waits_once(cluster, name, monkeypatch):
    """The hybrid leader's step holds SEASGD's waits (timed by SEASGD) in its own phases,
    each once (one node of one worker; the clock moves only by known amounts)."""
    import torch.distributed as dist

    from smb_client.torch import HybridSEASGD, new_node_groups
    from tests.integration.daemons import free_port
    clock = known_clock(monkeypatch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranks, groups = new_node_groups(1, 1)
        model = make_model()
        with cluster.client() as c:
            store = ParameterStore.create(c, name, model, scheme="hybrid", workers=1)
            try:
                with SEASGD(store, 0, 1, update_interval=2) as worker:
                    seasgd_clock(monkeypatch, worker, clock, push=5.0, read=3.0)
                    hy = HybridSEASGD(store.flat, groups[0], ranks[0], seasgd=worker)
                    lasts = []
                    for _ in range(STEPS):
                        hy.zero_grad()
                        model(torch.randn(4, 8)).sum().backward()
                        hy.synchronize()
                        clock.advance(1.0)
                        hy.after_step()
                        lasts.append(dict(hy.times.last))
                    hy.close()
            finally:
                store.destroy()
    finally:
        dist.destroy_process_group()
    assert lasts == SEASGD_STEPS
