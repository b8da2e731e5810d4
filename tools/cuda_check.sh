#!/usr/bin/env bash
# The checks of CUDA tensors through the memory box, on a host with a CUDA device:
# the `cuda`-marked tests, then bench/cuda_staging.py (staging throughput and training).
# Results go to $OUT (default ./cuda-check): cuda_tests.log, cuda_tests.xml, bench.log,
# cuda_staging.json, env.txt.
#
#   OUT=/tmp/cuda-check tools/cuda_check.sh
#
# Where the optional packages grpcio-health-checking or cryptography are missing (only
# the daemons' health service and TLS certificates use them, neither exercised here),
# import stand-ins are put on PYTHONPATH for this run only.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cuda-check}
PY=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
  lsmod 2>/dev/null | grep -E "nvidia_peermem|nv_peer_mem|ib_core" || echo "no peer-memory or ib_core module loaded"
  ls /sys/class/infiniband 2>/dev/null || echo "no RDMA devices"
} > "$OUT/env.txt" 2>&1

STUBS=$(mktemp -d)
if ! $PY -c 'import grpc_health.v1.health' 2>/dev/null; then
  mkdir -p "$STUBS/grpc_health/v1"
  touch "$STUBS/grpc_health/__init__.py" "$STUBS/grpc_health/v1/__init__.py"
  cat > "$STUBS/grpc_health/v1/health.py" <<'PYEOF'
class HealthServicer:
    def set(self, service, status):
        pass
PYEOF
  cat > "$STUBS/grpc_health/v1/health_pb2.py" <<'PYEOF'
class HealthCheckResponse:
    SERVING, NOT_SERVING = 1, 2
PYEOF
  cat > "$STUBS/grpc_health/v1/health_pb2_grpc.py" <<'PYEOF'
def add_HealthServicer_to_server(servicer, server):
    pass
PYEOF
  echo "stand-in: grpc_health" >> "$OUT/env.txt"
fi
if ! $PY -c 'import cryptography.x509' 2>/dev/null; then
  for d in cryptography cryptography/x509 cryptography/hazmat cryptography/hazmat/primitives \
           cryptography/hazmat/primitives/asymmetric; do
    mkdir -p "$STUBS/$d"
    echo 'def __getattr__(name): return object()' > "$STUBS/$d/__init__.py"
  done
  for m in x509/oid hazmat/primitives/hashes hazmat/primitives/serialization hazmat/primitives/asymmetric/ec; do
    echo 'def __getattr__(name): return object()' > "$STUBS/cryptography/$m.py"
  done
  echo "stand-in: cryptography" >> "$OUT/env.txt"
fi
export PYTHONPATH=$PYTHONPATH:$STUBS

timeout "$TEST_TIMEOUT" $PY -m pytest -p no:cacheprovider -q -ra -m cuda tests/cuda \
  --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/env.txt"
tail -25 "$OUT/cuda_tests.log"

timeout "$BENCH_TIMEOUT" $PY bench/cuda_staging.py --sizes "${SIZES:-64,256,1024}" --train-steps "${STEPS:-20}" \
  --out "$OUT/cuda_staging.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/env.txt"
tail -40 "$OUT/bench.log"
