"""``smb doctor``: is this host ready for the rdma transport?

Checks, in order: pyverbs imports; RDMA devices exist; each port is ACTIVE; the GID
table has a RoCEv2 IPv4-mapped GID; the active MTU; the locked-memory limit
(``ulimit -l``, which bounds registered memory); and a loopback self-test on the
device (two RC endpoints of :mod:`smb_protocol.rdma.endpoint`, an RDMA WRITE then an RDMA READ of a small buffer,
verified). Each failed check says what to fix. Exit status 0 when every check passes,
1 otherwise.
"""
from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from smb_protocol.rdma import verbs
from smb_protocol.rdma.endpoint import RcEndpoint

log = logging.getLogger(__name__)

MEMLOCK_MIN = 64 << 20        # bytes; below this (and without CAP_IPC_LOCK) registrations fail
SELFTEST_BYTES = 64 << 10     # bytes moved by the loopback self-test
SELFTEST_TIMEOUT = 10.0       # seconds
GOOD_MTU = 4096               # bytes; smaller active MTUs work but cost bandwidth
RXE_HINT = ("for a test setup without RDMA hardware, use Soft-RoCE: "
            "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <netdev>`")


@dataclass
class Report:
    """Check results, printed as they come (``out``)."""

    out: TextIO = sys.stdout
    failed: list[str] = field(default_factory=list)

    def ok(self, what: str) -> None:
        print(f"[ ok ] {what}", file=self.out)

    def warn(self, what: str, fix: str = "") -> None:
        print(f"[warn] {what}" + (f"\n       fix: {fix}" if fix else ""), file=self.out)

    def fail(self, what: str, fix: str) -> None:
        self.failed.append(what)
        print(f"[FAIL] {what}\n       fix: {fix}", file=self.out)


def check_memlock(report: Report) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        report.ok("locked-memory limit (ulimit -l): unlimited")
        return
    text = f"locked-memory limit (ulimit -l): {soft >> 10} KiB"
    if os.geteuid() == 0:
        report.ok(text + " (root has CAP_IPC_LOCK: not enforced)")
    elif soft < MEMLOCK_MIN:
        report.fail(text + f", below {MEMLOCK_MIN >> 20} MiB: registering extents and buffers will fail",
                    "raise it: `ulimit -l unlimited` (hard limit permitting), `LimitMEMLOCK=infinity` in "
                    "the systemd unit, or `* - memlock unlimited` in /etc/security/limits.conf")
    else:
        report.warn(text + "; memory servers register all their capacity",
                    "make it at least the server's --capacity plus 1 GiB, or unlimited")


def _netdev(device: str) -> str:
    path = f"{verbs.SYSFS_DEVICES}/{device}/ports/{verbs.PORT_NUM}/gid_attrs/ndevs/0"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "<netdev>"


def check_device(report: Report, name: str) -> verbs.Device | None:
    """Port state, GID and MTU of one device; returns it opened when usable."""
    try:
        dev = verbs.Device(name)
    except Exception as exc:
        report.fail(f"{name}: cannot open: {exc}",
                    "check /dev/infiniband permissions (rdma group) and the provider library "
                    "(ibverbs-providers)")
        return None
    info = dev.info
    netdev = _netdev(name)
    if info.active:
        report.ok(f"{name}: port {verbs.PORT_NUM} ACTIVE (netdev {netdev})")
    else:
        report.fail(f"{name}: port {verbs.PORT_NUM} is not ACTIVE (state {info.port_state})",
                    f"bring the link up: `ip link set {netdev} up`; check cabling/switch (`ibv_devinfo`)")
    try:
        entries = verbs.gid_table(dev.ctx)
    except Exception as exc:
        entries = []
        report.fail(f"{name}: cannot read the GID table: {exc}", "check `ibv_devinfo -v`")
    mapped = [g for g in entries if g.roce_v2 and g.ipv4]
    if mapped:
        report.ok(f"{name}: RoCEv2 IPv4-mapped GID at index {mapped[0].index} ({mapped[0].ipv4})"
                  + (f"; {len(mapped) - 1} more" if len(mapped) > 1 else ""))
    else:
        report.fail(f"{name}: no RoCEv2 IPv4-mapped GID ({len(entries)} GIDs)",
                    f"give {netdev} an IPv4 address (`ip addr add <ip>/<len> dev {netdev}`)")
    mtu = info.active_mtu
    if mtu >= GOOD_MTU:
        report.ok(f"{name}: active MTU {mtu} bytes")
    else:
        report.warn(f"{name}: active MTU {mtu} bytes (peers negotiate the smaller of both ends)",
                    f"for bandwidth, use jumbo frames: `ip link set {netdev} mtu 9000` on every host "
                    "and switch port")
    return dev


def loopback_selftest(dev: verbs.Device) -> None:
    """Two RC endpoints on ``dev`` wired to each other: RDMA WRITE a pattern from A into
    B, RDMA READ it back into A, compare. Raises RuntimeError with the reason."""
    import numpy as np
    import pyverbs.enums as e

    rw = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE)
    n = SELFTEST_BYTES
    eps: list[RcEndpoint] = []
    try:
        for _ in range(2):
            eps.append(RcEndpoint(dev, 2 * n, sq_depth=8, recv_slots=0, slot_bytes=n, cq_depth=16,
                                  access=rw))
        a, b = eps
        a.connect(b.local_info(), dev.info.active_mtu, rw, 1)
        b.connect(a.local_info(), dev.info.active_mtu, rw, 1)
        pattern = np.random.default_rng().integers(0, 256, n, dtype=np.uint8).tobytes()
        a.view[:n] = pattern

        def run(op: str, laddr: int) -> None:
            assert b.buffer is not None
            a.post(1, True, op, laddr, n, rkey=b.buffer.rkey, raddr=b.base)
            deadline = time.monotonic() + SELFTEST_TIMEOUT
            while True:
                wcs = a.poll(1)
                if wcs:
                    if wcs[0].status != e.IBV_WC_SUCCESS:
                        raise RuntimeError(f"completion {verbs.wc_status_name(wcs[0].status)}")
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no completion within {SELFTEST_TIMEOUT} s")
                time.sleep(0.001)

        run("write", a.base)
        if bytes(b.view[:n]) != pattern:
            raise RuntimeError("RDMA WRITE completed but the target bytes differ")
        run("read", a.base + n)
        if bytes(a.view[n:2 * n]) != pattern:
            raise RuntimeError("RDMA READ completed but the bytes read back differ")
    finally:
        for ep in reversed(eps):
            try:
                ep.close()
            except Exception as exc:
                log.debug("close failed: %s", exc)


def check_gpudirect(report: Report, modules: str = "/proc/modules") -> None:
    """Say whether the kernel can let an RDMA NIC reach GPU memory (GPUDirect RDMA:
    the ``nvidia_peermem`` module, or the older ``nv_peer_mem``). Informational: the
    client stages CUDA tensors through pinned host memory either way (docs/rdma.md)."""
    try:
        with open(modules) as f:
            loaded = {line.split()[0] for line in f if line.strip()}
    except OSError:
        return
    if not any(m.startswith("nvidia") for m in loaded):
        return                         # no NVIDIA driver: nothing to say
    peer = sorted(loaded & {"nvidia_peermem", "nv_peer_mem"})
    if peer:
        report.ok(f"GPUDirect RDMA kernel module loaded ({peer[0]}); CUDA tensors are still staged "
                  "through pinned host memory")
    else:
        report.warn("GPUDirect RDMA module (nvidia_peermem) not loaded: CUDA tensors are staged through "
                    "pinned host memory", "`modprobe nvidia_peermem` where the NIC and driver support it")


def run_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run every check; print findings; 0 when all pass, else 1."""
    report = Report(out or sys.stdout)
    if verbs.pyverbs_available():
        report.ok("pyverbs imports")
    else:
        report.fail("pyverbs is not importable",
                    "install the distribution's python3-pyverbs (rdma-core) and create the virtualenv "
                    "with --system-site-packages")
    names = verbs.device_names()
    wanted = getattr(args, "device", None) or os.environ.get(verbs.ENV_DEVICE) or None
    if wanted:
        names = [n for n in names if n == wanted] or names
    check_memlock(report)
    check_gpudirect(report)
    if not names:
        report.fail("no RDMA device on this host (/sys/class/infiniband is empty or missing); "
                    "clients will use tcp (or shm on the server's host)",
                    "load the driver of the RDMA NIC (e.g. `modprobe mlx5_ib`), or " + RXE_HINT)
    elif verbs.pyverbs_available():
        for name in names if not wanted else [wanted]:
            dev = check_device(report, name)
            if dev is None:
                continue
            try:
                loopback_selftest(dev)
                report.ok(f"{name}: loopback self-test (RDMA WRITE + READ of {SELFTEST_BYTES >> 10} KiB) "
                          "passed")
            except Exception as exc:
                report.fail(f"{name}: loopback self-test failed: {exc}",
                            "check the port and GID above; with Soft-RoCE make sure the netdev is up; "
                            "run `ibv_rc_pingpong -d " + name + " -g <gid index>` for details")
            finally:
                dev.close()
    if report.failed:
        print(f"\n{len(report.failed)} check(s) failed: the rdma transport is not usable here.",
              file=report.out)
        return 1
    print("\nall checks passed: the rdma transport is usable.", file=report.out)
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``smb doctor`` to the CLI's subcommands."""
    p = subparsers.add_parser("doctor", help="check this host's RDMA setup (device, port, GID, MTU, "
                                             "ulimit -l, loopback self-test)",
                                 description="Checks what one-sided RDMA needs on this host: an RDMA "
                                             "device and an active port, a usable GID, the MTU, the "
                                             "memlock limit (ulimit -l) and a loopback self-test. Each "
                                             "check prints OK or FAIL with the fix; exit 0 when all pass, "
                                             "1 otherwise.")
    p.add_argument("--device", default="", help="check only this RDMA device (default: all)")
    p.set_defaults(fn=run_doctor)
    return p
