"""The playbook's etcd play (deploy/ansible/site.yml, group smb_etcd), run for real
against this machine with a local connection: it installs the distribution's etcd and
writes the member's environment file; the test then starts etcd with exactly that
environment (systemd, which would, is not PID 1 here) and talks to it, and checks the
store URL the controllers are given."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

from smb_server.controller.stores.etcd import kv
from tests.integration.deploy.playbook import playbook_marks, read_env_file, run_playbook

pytestmark = playbook_marks("installs packages")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_etcd_play_configures_a_member_that_runs(tmp_path: Path) -> None:
    client_port, peer_port = _free_port(), _free_port()
    env_file = tmp_path / "etcd.env"
    variables = {
        "smb_etcd_hosts": "localhost", "smb_etcd_members": ["localhost"],
        "smb_controller_hosts": "no_controller_here", "smb_memory_server_hosts": "no_server_here",
        "ansible_host": "127.0.0.1", "smb_etcd_listen_host": "127.0.0.1",
        "smb_etcd_client_port": client_port, "smb_etcd_peer_port": peer_port,
        "smb_etcd_env_file": str(env_file), "smb_etcd_data_dir": str(tmp_path / "etcd-data"),
        "smb_manage_services": False, "smb_apt_update_cache": False,
    }
    stdout = run_playbook(tmp_path, variables)
    assert f"controllers' store: etcd://127.0.0.1:{client_port}/smb" in stdout
    assert shutil.which("etcd") and shutil.which("etcdctl")

    settings = read_env_file(env_file)
    assert settings["ETCD_NAME"] == "localhost"
    assert settings["ETCD_INITIAL_CLUSTER"] == f"localhost=http://127.0.0.1:{peer_port}"
    member = subprocess.Popen([shutil.which("etcd") or "etcd"], env={"PATH": "/usr/bin:/bin", **settings},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{client_port}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            assert member.poll() is None and time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.1)
        store = kv.EtcdKV(*kv.parse_url(f"etcd://127.0.0.1:{client_port}")[:1])
        assert store.txn([kv.absent("/smb/probe")], [kv.put("/smb/probe", "1")]).succeeded
        assert store.get("/smb/probe") is not None
        store.close()
    finally:
        member.send_signal(signal.SIGTERM)
        member.wait(20)
