"""``smb doctor`` on a host with a working Soft-RoCE device passes every check."""
from __future__ import annotations

import argparse
import io

import pytest

from smb_server.commands import doctor

pytestmark = pytest.mark.rdma


def test_doctor_passes_on_rxe0():
    out = io.StringIO()
    rc = doctor.run_doctor(argparse.Namespace(device="rxe0"), out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert "loopback self-test" in text and "RoCEv2 IPv4-mapped GID" in text
