#!/usr/bin/env bash
# Inside the VM (run_vm.sh's default command): the rdma test tier, then the benchmark.
#   vm_tier.sh OUT_DIR
OUT=$1
rc=0
export SMB_TEST_LOGDIR="$OUT/logs"
rm -rf "$SMB_TEST_LOGDIR"; mkdir -p "$SMB_TEST_LOGDIR"
# hypothesis's pytest plugin is left out: no test here uses it, and its import (1.3 s on
# a host) runs 30-75 times slower under the VM's emulated CPUs, as others do. A test's
# limit counts the start of its module's cluster (one to two minutes in the VM).
.venv/bin/python -m pytest -p no:cacheprovider -p no:hypothesispytest -q -ra --durations=25 tests/rdma --timeout=600 \
  --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
dmesg | tail -n 80 > "$OUT/dmesg.log"
if [ "${SMB_VM_BENCH:-1}" = 1 ] && [ -f bench/rdma.py ]; then
  .venv/bin/python bench/rdma.py --out "$OUT/rdma.json" 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$brc
fi
exit "$rc"
