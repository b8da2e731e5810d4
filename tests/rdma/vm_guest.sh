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
"$@"
rc=$?
echo "guest: command exited with $rc"
echo "$rc" > "$OUT/rc"
sync
