"""``smb doctor`` on a host without an RDMA device: says so, says what to do, exits 1."""
from __future__ import annotations

import argparse
import io

import pytest

from smb_protocol.rdma import verbs
from smb_server.commands import doctor


@pytest.mark.skipif(bool(verbs.device_names()), reason="this host has an RDMA device")
def test_doctor_without_device_fails_clearly():
    out = io.StringIO()
    rc = doctor.run_doctor(argparse.Namespace(device=""), out=out)
    text = out.getvalue()
    assert rc == 1
    assert "[FAIL] no RDMA device on this host" in text
    assert "modprobe rdma_rxe" in text and "fix:" in text
    assert "locked-memory limit" in text
    assert "check(s) failed" in text


def test_doctor_parser():
    parser = argparse.ArgumentParser()
    doctor.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--device", "rxe0"])
    assert args.fn is doctor.run_doctor and args.device == "rxe0"
