#!/usr/bin/env bash
# Boot a small VM with Soft-RoCE (rdma_rxe) and run the RDMA test tier inside it.
#
#   tests/rdma/run_vm.sh                 # pytest tests/rdma + bench/rdma.py, results in .rdma-vm/
#   tests/rdma/run_vm.sh -- CMD ARGS...  # run any command in the VM instead (from the repo root)
#
# Environment: SMB_VM_OUT (results folder, default .rdma-vm), SMB_VM_KERNEL (default: the
# newest /boot/vmlinuz-*), SMB_VM_MEMORY (4G), SMB_VM_CPUS (2), SMB_VM_CPU (QEMU's -cpu, see
# below), SMB_VM_TIMEOUT (seconds, 900), SMB_VM_BENCH=0 to skip the benchmark. Needs
# qemu-system-x86, virtme-ng (vng) in the project's venv, and a kernel with the rdma_rxe
# module (Debian's linux-image-amd64).
# The exit status is the guest command's; a VM that does not start is a failure (99).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${SMB_VM_OUT:-$REPO/.rdma-vm}" && cd "${SMB_VM_OUT:-$REPO/.rdma-vm}" && pwd)
PY="$REPO/.venv/bin/python"
KERNEL=${SMB_VM_KERNEL:-$(ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1 || true)}
export PATH="$REPO/.venv/bin:$PATH"   # vng calls virtme-run from its own folder

fail() { echo "run_vm.sh: FAILED: $*" >&2; exit 99; }
[ -n "$KERNEL" ] && [ -r "$KERNEL" ] || fail "no readable kernel in /boot (install linux-image-amd64)"
command -v vng >/dev/null || fail "vng not found: $REPO/.venv/bin/pip install virtme-ng==1.42"
command -v qemu-system-x86_64 >/dev/null || fail "qemu-system-x86_64 not found (apt-get install qemu-system-x86)"
[ -x "$PY" ] || fail "no virtualenv at $REPO/.venv (make venv)"

CUSTOM=0
if [ "${1:-}" = "--" ]; then
  shift
  CUSTOM=1
  CMD=("$@")
else
  CMD=(env "SMB_VM_BENCH=${SMB_VM_BENCH:-1}" bash "$REPO/tests/rdma/vm_tier.sh" "$OUT")
fi
# The guest's CPU is QEMU's emulated "max" without the AVX family: QEMU 7.2 emulating
# AVX2 without KVM made memory servers die of SIGSEGV inside numpy's AVX2 float adds
# (2 of 3 runs of the concurrent-writers check; faulthandler's stacks in their logs),
# and the project's own kernels are compiled with AVX2 and F16C variants too. A CPU that
# does not claim the features makes numpy and the kernels take their baseline paths;
# real CPUs run the AVX2 paths (the host suite).
CPU=${SMB_VM_CPU:-max,avx=off,avx2=off,fma=off,f16c=off}
rm -f "$OUT/rc" "$OUT/guest.log"
echo "run_vm.sh: kernel $KERNEL, results in $OUT"
start=$(date +%s)
set +e
timeout "${SMB_VM_TIMEOUT:-900}" vng --run "$KERNEL" --user root --disable-kvm --force-9p \
  --memory "${SMB_VM_MEMORY:-4G}" --cpus "${SMB_VM_CPUS:-2}" --rwdir "$OUT" --qemu-opts="-cpu $CPU" \
  --exec "$REPO/tests/rdma/vm_guest.sh $OUT $REPO $(printf '%q ' "${CMD[@]}")" > "$OUT/vm.log" 2>&1
vm_rc=$?
set -e
echo "run_vm.sh: VM exited with $vm_rc after $(( $(date +%s) - start )) s"
if [ ! -s "$OUT/rc" ]; then
  tail -n 40 "$OUT/vm.log" >&2 || true
  fail "the guest never reported a result (VM did not boot, or the guest script crashed; see $OUT/vm.log)"
fi
rc=$(cat "$OUT/rc")
if [ "$CUSTOM" = 0 ] && [ -s "$OUT/pytest.log" ]; then
  echo "run_vm.sh: the rdma tier inside the VM ($OUT/pytest.log):"
  grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" || true
  tail -n 1 "$OUT/pytest.log"
fi
if [ -s "$OUT/rdma.json" ] && [ "$CUSTOM" = 0 ]; then
  mkdir -p "$REPO/bench/results" && cp "$OUT/rdma.json" "$REPO/bench/results/rdma.json"
  echo "run_vm.sh: benchmark results in bench/results/rdma.json"
fi
echo "run_vm.sh: guest command exited with $rc"
exit "$rc"
