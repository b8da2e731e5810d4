"""The systemd units in deploy/systemd: `systemd-analyze verify` passes, the hardening
keeps its exposure score and leaves RDMA working, and the readiness protocol
(``Type=notify``) that the units rely on."""
from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from smb_server.runtime import sdnotify

ROOT = Path(__file__).resolve().parents[4]
UNITS = ROOT / "deploy" / "systemd"
SMB = Path(sys.executable).parent / "smb"
EXPOSURE_MAX = 50   # systemd-analyze security, in tenths: 5.0 and above is "MEDIUM"

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze is not installed (apt package systemd)")


def render(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointing at this checkout's smb (verify checks that the
    binary exists), the template instantiated as smb-server@0."""
    assert os.access(SMB, os.X_OK), f"{SMB} missing: run `make deps`"
    paths = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text()
        assert "/opt/smb/venv/bin/smb " in text
        name = unit.name.replace("@.service", "@0.service")
        (tmp_path / name).write_text(text.replace("/opt/smb/venv/bin/smb", str(SMB)))
        paths.append(tmp_path / name)
    assert [p.name for p in paths] == ["smb-controller.service", "smb-server@0.service"]
    return paths


def service_section(path: Path) -> dict[str, list[str]]:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment]
    values: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


@needs_systemd_analyze
def test_units_verify(tmp_path):
    paths = render(tmp_path)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, paths)],
                         capture_output=True, text=True, timeout=60)
    problems = [line for line in out.stderr.splitlines() if "smb-" in line]
    assert out.returncode == 0 and not problems, out.stderr


@needs_systemd_analyze
def test_verify_catches_a_missing_binary(tmp_path):
    """The check above can fail: a unit whose ExecStart does not exist is refused."""
    unit = tmp_path / "smb-controller.service"
    unit.write_text((UNITS / "smb-controller.service").read_text()
                    .replace("/opt/smb/venv/bin/smb", str(tmp_path / "nowhere" / "smb")))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "not executable" in out.stderr


@needs_systemd_analyze
def test_hardening_exposure_stays_low(tmp_path):
    for path in render(tmp_path):
        out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                              f"--threshold={EXPOSURE_MAX}", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{path.name}: {out.stdout[-400:]}{out.stderr}"
        assert "Overall exposure level" in out.stdout


def test_server_unit_keeps_rdma_working():
    unit = service_section(UNITS / "smb-server@.service")
    assert unit["LimitMEMLOCK"] == ["infinity"]                   # registrations pin memory
    for closes_devices in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert closes_devices not in unit, f"{closes_devices} would hide /dev/infiniband"
    families = unit["RestrictAddressFamilies"][0].split()
    assert "AF_NETLINK" in families                                # rdma-core's device discovery
    assert unit["ProtectSystem"] == ["strict"] and unit["NoNewPrivileges"] == ["yes"]


@pytest.mark.parametrize("name", ["smb-controller.service", "smb-server@.service"])
def test_units_run_as_a_dedicated_user_with_readiness_and_restart(name):
    unit = service_section(UNITS / name)
    assert unit["User"] == ["smb"] and unit["Group"] == ["smb"]
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["Restart"] == ["on-failure"] and unit["KillSignal"] == ["SIGTERM"]
    assert unit["ReadWritePaths"] == ["/var/lib/smb"]
    kind = "controller" if "controller" in name else "server"
    assert unit["ExecStart"] == [f"/opt/smb/venv/bin/smb {kind} --config /etc/smb/{kind}.toml"]


def test_server_instances_have_their_own_state_and_overrides():
    unit = service_section(UNITS / "smb-server@.service")
    assert unit["Environment"] == ["SMB_STATE_DIR=/var/lib/smb/server-%i"]
    assert unit["EnvironmentFile"] == ["-/etc/smb/server-%i.env"]


def test_sd_notify_sends_to_the_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.notify("READY=1\nSTATUS=serving")
        assert sock.recv(1024) == b"READY=1\nSTATUS=serving"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sdnotify.notify("READY=1")           # not under systemd: nothing to tell
