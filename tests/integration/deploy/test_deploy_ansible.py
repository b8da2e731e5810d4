"""The Ansible playbook (deploy/ansible/site.yml), run for real against this machine
with a local connection, as root, with every path (install prefix, /etc/smb, the unit
directory, the state directory, the generated credentials) under a temporary
directory. Only starting the units is left out (smb_manage_services=false): it needs
systemd as PID 1. The distribution packages, the system user, the virtualenv and the
package, the configuration files and the units are installed for real; the test then
checks what landed, runs the installed `smb`, loads the installed configuration the
way the daemons will (file, then each instance's SMB_* file) and verifies the
installed units with systemd-analyze.

Speed: the package goes in as a wheel built from this checkout with --no-deps, and
the virtualenv sees this checkout's dependencies through smb_venv_extra_site_packages,
so nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from smb_server.runtime.certs import make_cluster_certs
from smb_server.runtime.config import ControllerConfig, ServerConfig, load
from tests.integration.deploy.playbook import ANSIBLE, ROOT, VENV_BIN, playbook_marks, read_env_file, run_playbook

pytestmark = playbook_marks("installs packages and a user")


def build_wheel(tmp_path: Path) -> Path:
    """A wheel of this checkout (generated stubs included), built from a copy so that
    the checkout gets no build/ directory."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "setup.py", src)       # the native kernels, compiled into the wheel
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for pkg in ("smb_protocol", "smb_client", "smb_server", "smb_train"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    assert (src / "smb_protocol" / "_proto" / "smb" / "v1" / "controller_pb2.py").exists(), "run make proto"
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(dist), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("soft_memory_box-*.whl")
    return wheel


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ansible")
    root = tmp / "root"
    wheel = build_wheel(tmp)
    certs = make_cluster_certs(str(tmp / "tls"), ["127.0.0.1"])
    variables = {
        "smb_prefix": f"{root}/opt/smb",
        "smb_etc_dir": f"{root}/etc/smb",
        "smb_state_dir": f"{root}/var/lib/smb",
        "smb_unit_dir": f"{root}/etc/systemd/system",
        "smb_credentials_dir": f"{tmp}/credentials",
        "smb_manage_services": False,
        "smb_apt_update_cache": False,
        "smb_package_src": str(wheel),
        "smb_pip_extra_args": "--no-deps --no-index",
        "smb_venv_extra_site_packages": [sysconfig.get_paths()["purelib"]],
        "smb_controller_hosts": "localhost",
        "smb_memory_server_hosts": "localhost",
        "smb_controller_address": "127.0.0.1:7700",
        "smb_tls_ca_src": certs.ca, "smb_tls_cert_src": certs.server_cert,
        "smb_tls_key_src": certs.server_key, "smb_tls_client_auth": True,
        "smb_server_instances": [
            {"name": "0", "capacity": "1G", "grpc_port": 7710, "tcp_port": 7711, "metrics_port": 9710},
            {"name": "numa1", "capacity": "2G", "grpc_port": 7720, "tcp_port": 7721, "numa_node": 1,
             "data_dir": f"{root}/var/lib/smb/server-numa1/data"},
        ],
    }

    def play() -> str:
        return run_playbook(tmp, variables)

    return {"root": root, "vars": variables, "output": play(), "play": play}


def test_playbook_ran_everything_but_the_service_start(deployed):
    recap = deployed["output"].split("PLAY RECAP")[-1]
    assert "failed=0" in recap and "unreachable=0" in recap
    out = deployed["output"]
    assert "TASK [smb : Install the distribution packages (RDMA user space, pyverbs, venv)]" in out
    start = out.split("TASK [smb : Enable and start the controller]")[1].split("TASK [")[0]
    assert "skipping: [localhost]" in start


def test_package_installed_in_its_own_virtualenv(deployed):
    venv = Path(deployed["vars"]["smb_prefix"]) / "venv"
    smb = venv / "bin" / "smb"
    assert os.access(smb, os.X_OK)
    run = subprocess.run([str(smb), "--help"], capture_output=True, text=True, timeout=60, cwd=deployed["root"])
    assert run.returncode == 0 and "controller" in run.stdout
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import smb_server, smb_protocol._proto.smb.v1.controller_pb2 as p; "
                            "print(smb_server.__file__)"], capture_output=True, text=True, timeout=60,
                           cwd=deployed["root"])
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv))        # the wheel's copy, not this checkout
    assert (Path(deployed["vars"]["smb_prefix"]) / "docs" / "operations.md").exists()


def test_configuration_files_load_as_the_daemons_will(deployed):
    etc = Path(deployed["vars"]["smb_etc_dir"])
    state = deployed["vars"]["smb_state_dir"]
    for name in ("controller.toml", "server.toml", "secret", "server-0.env", "server-numa1.env"):
        mode = stat.S_IMODE((etc / name).stat().st_mode)
        assert mode == 0o640, f"{name}: {oct(mode)}"           # the token and the secret stay private
    ctl = load(ControllerConfig, str(etc / "controller.toml"), env={})
    assert ctl.listen == "0.0.0.0:7700" and ctl.db_path == f"{state}/controller.db"
    assert ctl.metrics_port == 9700 and len(ctl.secret) == 32 and len(ctl.token) == 32
    for instance in deployed["vars"]["smb_server_instances"]:
        env = read_env_file(etc / f"server-{instance['name']}.env")
        srv = load(ServerConfig, str(etc / "server.toml"), env=env)
        assert srv.controller == "127.0.0.1:7700" and srv.token == ctl.token and srv.secret == ctl.secret
        assert srv.capacity == int(instance["capacity"][0]) << 30
        assert (srv.grpc_port, srv.tcp_port) == (instance["grpc_port"], instance["tcp_port"])
        assert srv.state_dir == f"{state}/server-{instance['name']}"
        assert srv.data_dir == instance.get("data_dir", "")
        assert srv.transports == ["tcp", "shm", "rdma"]
        assert Path(srv.state_dir).is_dir()
    assert Path(deployed["vars"]["smb_server_instances"][1]["data_dir"]).is_dir()


def test_tls_files_installed_and_named_by_both_configurations(deployed):
    etc = Path(deployed["vars"]["smb_etc_dir"])
    tls = etc / "tls"
    for name, mode in (("ca.pem", 0o644), ("cert.pem", 0o644), ("key.pem", 0o640)):
        assert stat.S_IMODE((tls / name).stat().st_mode) == mode, name
    assert (tls / "key.pem").read_bytes() == Path(deployed["vars"]["smb_tls_key_src"]).read_bytes()
    ctl = load(ControllerConfig, str(etc / "controller.toml"), env={})
    srv = load(ServerConfig, str(etc / "server.toml"), env=read_env_file(etc / "server-0.env"))
    for cfg in (ctl, srv):
        assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == (str(tls / "ca.pem"), str(tls / "cert.pem"),
                                                          str(tls / "key.pem"))
        assert cfg.tls_client_auth is True


def test_installed_units_point_at_the_installation_and_verify(deployed):
    units = Path(deployed["vars"]["smb_unit_dir"])
    prefix, etc = deployed["vars"]["smb_prefix"], deployed["vars"]["smb_etc_dir"]
    ctl = (units / "smb-controller.service").read_text()
    assert f"ExecStart={prefix}/venv/bin/smb controller --config {etc}/controller.toml" in ctl
    srv = (units / "smb-server@.service").read_text()
    assert f"EnvironmentFile=-{etc}/server-%i.env" in srv and "LimitMEMLOCK=infinity" in srv
    assert f"ReadWritePaths={deployed['vars']['smb_state_dir']}" in srv
    numa = (units / "smb-server@numa1.service.d" / "numa.conf").read_text()
    assert "NUMAPolicy=bind" in numa and "NUMAMask=1" in numa
    assert not (units / "smb-server@0.service.d").exists()
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt package systemd)")
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", "smb-controller.service",
                          "smb-server@0.service", "smb-server@numa1.service"],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, SYSTEMD_UNIT_PATH=f"{units}:"))
    problems = [line for line in out.stderr.splitlines() if "smb-" in line]
    assert out.returncode == 0 and not problems, out.stderr


def test_second_run_changes_nothing(deployed):
    recap = deployed["play"]().split("PLAY RECAP")[-1]
    assert "changed=0" in recap and "failed=0" in recap, recap


def test_rolling_restart_playbook_parses():
    out = subprocess.run([str(VENV_BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,",
                          str(ANSIBLE / "rolling-restart.yml")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
