#!/usr/bin/env bash
# Runs inside the Soft-RoCE VM (started by tests/rdma/run_vm.sh); do not run on a host.
#   vm_guest.sh OUT_DIR REPO_DIR COMMAND...
# Brings up rxe0 on lo and, for the two-namespace tests, two veth-backed rxe devices,
# runs COMMAND from REPO_DIR, and writes its exit status to OUT_DIR/rc.
set -uo pipefail
OUT=$1; REPO=$2; shift 2
exec > >(tee -a "$OUT/guest.log") 2>&1
echo "guest: kernel $(uname -r), $(nproc) cpus"
set -x
ip link set lo up
modprobe rdma_rxe || { echo "guest: cannot load rdma_rxe"; echo 90 > "$OUT/rc"; exit 90; }
rdma link add rxe0 type rxe netdev lo || { echo 91 > "$OUT/rc"; exit 91; }
# Two "hosts" for multi-server tests: veth pairs whose host ends stay in the initial
# namespace (rxe on kernel 6.1 only works there), peers in namespaces smb-a / smb-b.
if [ -f "$REPO/tests/rdma/netns_setup.sh" ]; then
  bash "$REPO/tests/rdma/netns_setup.sh" || echo "guest: netns setup failed (netns tests will fail)"
fi
set +x
ibv_devices
cd "$REPO"
export PYTHONDONTWRITEBYTECODE=1 HOME=/tmp TMPDIR=/tmp SMB_RDMA_VM=1
# the guest CPU is emulated (no KVM): a gRPC handshake that takes milliseconds on a host
# can take tens of seconds here while other processes import torch
export SMB_RDMA_CONNECT_TIMEOUT=${SMB_RDMA_CONNECT_TIMEOUT:-120}
# for the same reason, a local cluster's daemons get longer to become ready
export SMB_START_TIMEOUT=${SMB_START_TIMEOUT:-120}
# QEMU 7.2's emulated AVX2 (TCG, no KVM) crashes numpy's AVX2 float adds with SIGSEGV:
# memory servers died in np.add while accumulating (2 of 3 and 2 of 4 runs of the
# concurrent-writers check; faulthandler's stacks in their logs), and none did in 4 runs
# with numpy kept to its SSE4.2 baseline. Real CPUs run the AVX2 paths (the host tier).
export NPY_DISABLE_CPU_FEATURES=${NPY_DISABLE_CPU_FEATURES:-X86_V3}
"$@"
rc=$?
echo "guest: command exited with $rc"
echo "$rc" > "$OUT/rc"
sync
