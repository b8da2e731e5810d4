"""The Slurm batch script (deploy/slurm/smb-job.sbatch): a controller and a memory
server come up, a training-like command runs against them, and the daemons stop
cleanly afterwards.

Two ways: for real, under a one-node Slurm cluster this test starts on localhost
(slurmctld and slurmd with a generated configuration in a temporary directory,
auth/none, no munge); and without Slurm, through the script's documented local
launcher. Every wait is bounded.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "deploy" / "slurm" / "smb-job.sbatch"
SMB = Path(sys.executable).parent / "smb"
JOB_TIMEOUT = 120       # seconds a job may take, queueing included
SLURM_START = 30        # seconds slurmctld and slurmd get to report the node idle

pytestmark = pytest.mark.slow

PROBE = """\
import json, sys
import numpy as np
import smb_client

with smb_client.connect() as c:
    servers = [s.server_id for s in c.list_servers() if s.state == "up"]
    r = c.create_region("job/probe", 1 << 20)
    r.write(0, np.arange(1024, dtype=np.float32))
    r.accumulate(0, np.ones(1024, dtype=np.float32))
    ok = bool((r.read(0, 4096, dtype="float32") == np.arange(1024) + 1).all())
    r.close()
with open(sys.argv[1], "w") as f:
    json.dump({"servers": servers, "ok": ok, "controller": __import__("os").environ["SMB_CONTROLLER"]}, f)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMB_", "SLURM_"))}
    env.update(SMB_BIN=str(SMB), SMB_CAPACITY="64M", SMB_TRANSPORTS="tcp,shm",
               SMB_PORT=str(free_port()), SMB_JOB_DIR=str(tmp_path / "job"), SMB_START_TIMEOUT="30")
    env.update(extra)
    return env


def check_job(tmp_path: Path, result: Path) -> None:
    data = json.loads(result.read_text())
    assert data["ok"] and len(data["servers"]) == 1
    job = tmp_path / "job"
    controller_log = (job / "controller.log").read_text()
    (server_log,) = [p.read_text() for p in job.glob("server-*.log")]
    # the script stopped the daemons with SIGTERM: the server told the controller and
    # released its extent, then the controller stopped
    assert "released 1 extent(s)" in server_log and "told the controller" in server_log
    assert f"server {data['servers'][0]} stopped (SIGTERM)" in controller_log
    assert "controller stopped" in controller_log
    env_file = (job / "env").read_text()
    assert f"export SMB_CONTROLLER={data['controller']}" in env_file
    assert oct((job / "secret").stat().st_mode & 0o777) == "0o600"


def test_local_launcher_runs_daemons_and_command(tmp_path):
    """The one-node fallback (SMB_LAUNCHER=local, also taken when srun is missing), with
    the environment a one-node job has."""
    (tmp_path / "probe.py").write_text(PROBE)
    result = tmp_path / "result.json"
    env = job_env(tmp_path, SMB_LAUNCHER="local", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1",
                  SLURM_JOB_NODELIST=socket.gethostname().split(".")[0], SLURM_SUBMIT_DIR=str(tmp_path))
    out = subprocess.run(["bash", str(SCRIPT), sys.executable, str(tmp_path / "probe.py"), str(result)],
                         capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the command exited with status 0" in out.stdout
    check_job(tmp_path, result)


def test_failing_command_fails_the_job_and_still_stops_the_daemons(tmp_path):
    env = job_env(tmp_path, SMB_LAUNCHER="local")
    out = subprocess.run(["bash", str(SCRIPT), sys.executable, "-c", "import sys; sys.exit(3)"],
                         capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, cwd=tmp_path)
    assert out.returncode == 3
    assert "controller stopped" in (tmp_path / "job" / "controller.log").read_text()


def test_bad_settings_are_refused(tmp_path):
    env = job_env(tmp_path, SMB_LAUNCHER="mpirun")
    out = subprocess.run(["bash", str(SCRIPT), "true"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "SMB_LAUNCHER must be srun or local" in out.stderr
    env = job_env(tmp_path, SMB_BIN=str(tmp_path / "no-smb"))
    out = subprocess.run(["bash", str(SCRIPT), "true"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "set SMB_BIN" in out.stderr
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "usage:" in out.stderr


# -- a real one-node Slurm ---------------------------------------------------------------
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")


class LocalSlurm:
    """slurmctld + slurmd for this host only, all state under ``workdir``; owns both."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.node = socket.gethostname().split(".")[0]
        self.conf = workdir / "slurm.conf"
        workdir.mkdir(parents=True, exist_ok=True)
        for d in ("state", "spool", "log"):
            (workdir / d).mkdir()
        self.conf.write_text(f"""\
ClusterName=smbtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={workdir}/state
SlurmdSpoolDir={workdir}/spool
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmdPidFile={workdir}/slurmd.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=smbtest Nodes=ALL Default=YES MaxTime=10 State=UP
""")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def start(self) -> LocalSlurm:
        for argv in (["slurmctld", "-D", "-i", "-f", str(self.conf)],
                     ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)]):
            with open(self.workdir / f"{argv[0]}.out", "wb") as out:
                self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                   env=self.env, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + SLURM_START
        while True:
            for p in self.procs:
                assert p.poll() is None, f"{p.args[0]} exited: {self.logs()}"
            state = subprocess.run(["sinfo", "-h", "-n", self.node, "-o", "%T"], capture_output=True,
                                   text=True, timeout=10, env=self.env).stdout.strip()
            if state == "idle":
                return self
            assert time.monotonic() < deadline, f"node state {state!r} after {SLURM_START} s: {self.logs()}"
            time.sleep(0.2)

    def run_batch(self, script: Path, args: list[str], env: dict[str, str], output: Path) -> tuple[str, int]:
        """Submit, wait for the end (bounded), return (final state, exit code)."""
        out = subprocess.run(["sbatch", "--parsable", f"--output={output}", str(script), *args],
                             capture_output=True, text=True, timeout=30, env=dict(env, SLURM_CONF=str(self.conf)))
        assert out.returncode == 0, out.stderr
        job = out.stdout.strip().split(";")[0]
        deadline = time.monotonic() + JOB_TIMEOUT
        while True:
            show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                                  timeout=10, env=self.env).stdout
            fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
            if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return fields["JobState"], int(fields["ExitCode"].split(":")[0])
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], timeout=10, env=self.env)
                raise AssertionError(f"job {job} still {fields.get('JobState')} after {JOB_TIMEOUT} s")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.workdir.glob("*.out")))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def slurm(tmp_path):
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; "
                    "apt packages slurmctld slurmd slurm-client)")
    if os.geteuid() != 0:
        pytest.skip("a private slurmd runs jobs as root only")
    cluster = LocalSlurm(tmp_path / "slurm")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_batch_script_under_slurm(tmp_path, slurm):
    (tmp_path / "probe.py").write_text(PROBE)
    result = tmp_path / "result.json"
    state, code = slurm.run_batch(SCRIPT, [sys.executable, str(tmp_path / "probe.py"), str(result)],
                                  job_env(tmp_path), tmp_path / "job.out")
    output = (tmp_path / "job.out").read_text()
    assert (state, code) == ("COMPLETED", 0), output + slurm.logs()
    assert "the command exited with status 0" in output
    data = json.loads(result.read_text())
    assert data["controller"].startswith(f"{slurm.node}:")         # the job's first node
    check_job(tmp_path, result)
