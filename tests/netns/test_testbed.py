"""The testbed: daemons inside their namespaces, capped links, data over the bridge,
the short experiments, and teardown that leaves nothing behind."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.cluster import experiments, netns
from bench.cluster.testbed import ROOT, SUBNET, Testbed, TestbedError, cleanup, kill_process

BURST = 128 * 1024   # bytes of a link's token bucket (netns.TBF_BURST, "128kb")

pytestmark = pytest.mark.netns

CAP_MBIT = 200.0


@pytest.fixture(scope="module")
def testbed():
    with Testbed(2, 2, cap_mbit=CAP_MBIT, log_level="INFO") as tb:
        yield tb


def _ours(tag: str) -> list[str]:
    return [n for n in netns.list_namespaces() if n.startswith(tag + "-")]


def test_daemons_run_inside_their_own_namespaces(testbed):
    assert netns.identify(testbed.pid("controller")) == testbed.controller.ns
    for i, host in enumerate(testbed.servers):
        assert netns.identify(testbed.pid(f"srv{i}")) == host.ns
    servers = testbed.list_servers()
    assert sorted(s["grpc_address"].rpartition(":")[0] for s in servers) == [h.address for h in testbed.servers]
    assert {s["state"] for s in servers} == {"up"}
    assert all(e.startswith(f"tcp://{SUBNET}.") for s in servers for e in s["endpoints"])
    # the network exists only inside the testbed's namespaces
    assert SUBNET + "." not in netns.run([netns.IP, "-o", "addr", "show"])
    assert len(_ours(testbed.tag)) == 2 + 2 + 2   # switch, controller, servers, workers


def test_every_link_is_capped_in_both_directions(testbed):
    for host in testbed.hosts:
        q = testbed.qdiscs(host)
        for side in ("host", "switch"):
            assert "tbf" in q[side] and f"rate {CAP_MBIT:g}Mbit" in q[side], (host.role, q)


def test_data_crosses_the_bridge_and_arrives_intact(testbed):
    before = [testbed.link_bytes(h) for h in testbed.servers]
    result = experiments.bandwidth(testbed, experiments.quick(), lambda message: None)
    after = [testbed.link_bytes(h) for h in testbed.servers]
    points = result["points"]
    assert [p["servers"] for p in points] == [1, 2]
    assert [p["region_servers"] for p in points] == [1, 2]
    assert all(p["verified"] for p in points)
    assert all(p["write_MBps"] > 0 and p["read_MBps"] > 0 for p in points)
    # every byte went through the memory servers' links (counted by their switch ports)
    to_servers = sum(a["to_host"] - b["to_host"] for a, b in zip(after, before, strict=True))
    from_servers = sum(a["from_host"] - b["from_host"] for a, b in zip(after, before, strict=True))
    assert to_servers >= sum(p["write_bytes"] for p in points)
    assert from_servers >= sum(p["read_bytes"] for p in points)


def test_sharding_short(testbed):
    result = experiments.sharding(testbed, experiments.quick(), lambda message: None)
    (point,) = result["points"]
    assert (point["workers"], point["servers"]) == (2, 2)
    for placement in ("striped", "layered"):
        assert point[placement]["verified"], placement
        assert len(point[placement]["steps"]) == experiments.QUICK.shard_steps
    # layered puts the big first layer whole on one server
    assert point["layered"]["max_server_share"] >= result["model"]["largest_share"]
    assert point["striped"]["max_server_share"] < point["layered"]["max_server_share"]


def test_aggregation_short_against_gloo():
    result = experiments.allreduce(experiments.quick(), lambda message: None)
    (point,) = result["points"]
    assert point["smb"]["verified"] and point["gloo"]["verified"]
    assert point["smb"]["seconds"] > 0 and point["gloo"]["seconds"] > 0
    assert point["transports"] == ["shm", "tcp"]     # the local server by shm, the other over the link
    assert point["collective"]["verified"] and point["collective"]["seconds"] > 0
    (dedicated,) = result["dedicated"]                 # workers and servers on hosts of their own
    assert (dedicated["workers"], dedicated["servers"], dedicated["colocated"]) == (2, 2, False)
    assert all(dedicated[system]["verified"] for system in ("smb", "collective", "pushpull", "bf16", "gloo"))
    # every host link sampled during the rounds: the sums crossed the links, and no
    # link carried more than its cap
    links = dedicated["links"]
    assert sorted(links["roles"]) == ["srv0", "srv1", "wrk0", "wrk1"]
    for system in ("collective", "pushpull", "gloo"):
        figures = links[system]
        assert figures["samples"] > 0 and 0 < figures["mean"] <= 1.1, (system, figures)
        timeline = figures["timeline"]
        # the cap is a token bucket: over a sample of dt seconds a link may carry its
        # rate plus one bucket (TBF_BURST), and no more (a tenth for the clocks)
        cap = result["link_MBps"] * 1e6
        for rates in timeline["up"].values():
            for rate, dt in zip(rates, timeline["dt"], strict=True):
                assert rate <= 1.1 + BURST / (cap * dt), (system, rate, dt, timeline)


def test_aggregation_with_some_servers_on_workers_hosts():
    """3 workers, 3 memory servers, one of them on worker 0's host: every sum exact; with
    the chunks shared by spare link capacity the co-located server sums 1/5 of the bytes
    (its link also carries its worker's traffic: 1 + x against 3x, equal at x = 1/5),
    dealt evenly 1/3."""
    result = experiments.mixed(experiments.quick(), lambda message: None)
    (point,) = result["points"]
    assert (point["workers"], point["servers"], point["shared_hosts"]) == (3, 3, 1)
    assert all(point[system]["verified"] for system in ("smb", "collective", "weighted", "gloo"))
    shared = {sid for sid, host in point["server_hosts"].items() if host in point["worker_hosts"]}
    assert len(shared) == 1

    def share(key: str) -> float:
        per = point[key]
        return sum(b for sid, b in per.items() if sid in shared) / sum(per.values())
    assert abs(share("even_bytes_per_server") - 1 / 3) < 0.05
    assert abs(share("weighted_bytes_per_server") - 1 / 5) < 0.05


def test_training_short_against_ddp():
    from bench.cluster import training
    result = training.run(experiments.quick(), lambda message: None)
    assert set(result["systems"]) == {"smb", "smb+hooks", "smb+hooks-bf16", "smb+hooks-fifo", "ddp", "ddp-fp16",
                                      "ddp-smb"}
    for system in result["systems"].values():
        assert system["same_weights"] and system["steps_per_second"] > 0
    # the collective's chunks on both dedicated servers
    assert len(result["systems"]["smb"]["chunk_bytes_per_server"]) == 2
    assert "| smb+hooks |" in training.table(result)


def test_an_interrupt_during_teardown_is_raised_once_it_is_done(monkeypatch):
    """SIGINT that lands while the testbed tears down is held until the teardown is done,
    then raised: nothing is left behind, and the run stops (ignored, as it was, a run
    interrupted then went on to its end)."""
    tb = Testbed(1, 0)
    tb.start()
    real = netns.delete_namespace
    interrupts = []

    def interrupted(name: str) -> None:
        if not interrupts:
            interrupts.append(name)
            os.kill(os.getpid(), signal.SIGINT)
        real(name)
    monkeypatch.setattr(netns, "delete_namespace", interrupted)
    # SIGINT raises KeyboardInterrupt here, as in `python -m bench.cluster`, also where
    # this process was started with SIGINT ignored (a background job of a shell, as CI
    # may run the suite): the stop raises it again with the disposition it found
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tb.stop()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupts and tb.state == "closed"
    assert _ours(tb.tag) == [] and not tb.workdir.exists()


def test_failed_start_leaves_nothing_behind():
    tb = Testbed(1, 0, capacity="no-such-size")
    with pytest.raises(TestbedError, match="srv0 exited"):
        tb.start()
    assert tb.state == "closed"
    assert _ours(tb.tag) == []
    assert not tb.workdir.exists()


def test_cleanup_removes_leftovers_of_dead_runs_only(testbed):
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{netns.PREFIX}{dead.pid}-0-sw"
    workdir = Path(tempfile.gettempdir()) / f"{netns.PREFIX}{dead.pid}-test"
    netns.add_namespace(leftover)
    workdir.mkdir()
    try:
        removed = cleanup()
        assert leftover in removed and str(workdir) in removed
        assert leftover not in netns.list_namespaces()
        assert not workdir.exists()
        # a live run keeps its namespaces and its work directory
        assert len(_ours(testbed.tag)) == 6
        assert testbed.workdir.exists()
    finally:
        netns.delete_namespace(leftover)
        shutil.rmtree(workdir, ignore_errors=True)


def _running_in(tag: str, but: str = "") -> bool:
    """Whether a process runs in a namespace whose name starts with ``tag`` (other than ``but``)."""
    for name in netns.list_namespaces():
        if name.startswith(tag) and name != but:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            if pids.strip():
                return True
    return False


@pytest.mark.parametrize("nth", [1, 2])
def test_an_interrupt_while_a_namespace_is_made_leaves_none(monkeypatch, nth):
    """SIGINT can land after ``ip netns add`` and before the testbed noted the name (a
    run interrupted as a process first runs in its switch's namespace once left that
    namespace behind): the namespace made then is deleted too."""
    made = []
    real = netns.add_namespace

    def interrupted(name: str) -> None:
        real(name)
        made.append(name)
        if len(made) == nth:
            raise KeyboardInterrupt
    monkeypatch.setattr(netns, "add_namespace", interrupted)
    tb = Testbed(1, 1)
    with pytest.raises(KeyboardInterrupt):
        tb.start()
    assert len(made) == nth and made[0] == tb.switch
    assert _ours(tb.tag) == [] and tb.state == "closed"


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(120)
def test_interrupted_run_tears_down(tmp_path):
    # started with SIGINT ignored, as a shell starts a background job (and as `make test`
    # runs under CI): the run installs its own handler, Ctrl-C still interrupts it
    proc = subprocess.Popen([sys.executable, "-m", "bench.cluster", "--quick", "--only", "bandwidth",
                             "--out", str(tmp_path / "out.json")], cwd=ROOT, preexec_fn=_sigint_ignored,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tag = f"{netns.PREFIX}{proc.pid}-"
    try:
        # interrupted as soon as a process runs in one of its testbed's namespaces (not the
        # probe's: the test below): mid-build or mid-experiment, never after its last point (a
        # quick run's points take about a second; a fixed pause could let the run reach its
        # end on a loaded machine)
        deadline = time.monotonic() + 60
        while not _running_in(tag, but=f"{tag}probe"):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run started no process in a namespace within 60 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [n for n in netns.list_namespaces() if n.startswith(tag)] == []
    assert not (tmp_path / "out.json").exists()


def test_an_interrupt_while_the_run_probes_for_namespaces_stops_it(tmp_path):
    """The run's first namespace is the probe's (``netns.unavailable_reason``, named like
    the testbed's), so an interrupt can come while it probes: it stops the run there, also
    one started with SIGINT ignored (it was lost there, and the run went on to write its
    results)."""
    script = ("import signal, sys\n"
              "from bench.cluster import __main__ as cli, netns\n"
              "probe = netns.unavailable_reason\n"
              "def interrupted():\n"
              "    signal.raise_signal(signal.SIGINT)\n"
              "    return probe()\n"
              "netns.unavailable_reason = interrupted\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-c", script, "--quick", "--only", "bandwidth", "--out", str(out)],
                            cwd=ROOT, preexec_fn=_sigint_ignored, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        kill_process(proc)
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    assert not out.exists()
    assert [n for n in netns.list_namespaces() if n.startswith(f"{netns.PREFIX}{proc.pid}-")] == []


def test_a_worker_past_its_time_is_named_with_every_threads_stack(testbed):
    # rank 1 of two, whose rank 0 never comes: it waits in allreduce (gloo's start) until killed
    spec = {"mode": "allreduce", "rank": 1, "world": 2, "master": testbed.workers[0].address,
            "master_port": 29999, "sizes": [4096], "tag": "stuck"}
    proc, out = testbed.start_worker(testbed.workers[1], "stuck-w1", spec)
    workers, error = testbed.watch_workers([("stuck-w1", proc, out)], timeout=10.0)
    assert workers == [] and proc.returncode is not None           # killed once reported
    assert error.startswith("workers still running after 10 s: stuck-w1"), error
    stacks = error.partition("stuck-w1, its threads:\n")[2]
    assert "most recent call first" in stacks and "in allreduce" in stacks, error
