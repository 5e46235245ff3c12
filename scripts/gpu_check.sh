#!/usr/bin/env bash
# One command for a machine with a GPU: build the environment (scripts/env.sh), run test/gpu and
# the micro benchmarks on CUDA, print a report against the goals (map <= 10 us, restore >= 90 %
# of pinned H2D, >= 95 % hidden, zero driver calls per decode step at steady state) and write it
# as JSON (benchmark/gpu_check_report.py says where each number comes from).
#
#   scripts/gpu_check.sh [pytest args]
#
# Without a usable GPU (torch sees no CUDA device, or cuda-python's driver binding does not
# load) it says so and runs the fake-driver suite instead (the CUDA backend, pool, arena,
# weight store and peer link on test/support/fake_cuda_driver.py); pytest args go to that run.
# Exit status: with a GPU, 0 when test/gpu passed and every goal is met; without one, the
# fake-driver suite's (0 when it passes).
#
# MEMX_PY=python skips the environment build; MEMX_GPU_CHECK_OUT (default
# benchmark/results/gpu_check) is where the JSON, the junit XML and the logs go.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${MEMX_PY:-$(scripts/env.sh)}
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whatever is installed
OUT=${MEMX_GPU_CHECK_OUT:-benchmark/results/gpu_check}
FAKE_SUITE=(test/unit/test_fake_cuda_driver.py test/unit/test_cuda_backend_on_fake_driver.py
            test/unit/test_pool_on_fake_cuda.py test/unit/test_vmm_conformance.py)

gpu=$("$PY" - <<'PY' || true
import torch
from memory_ext.vmm import cuda_available
if torch.cuda.is_available() and cuda_available():
    print(torch.cuda.get_device_name(0))
PY
)

if [ -z "$gpu" ]; then
  echo "gpu_check: no GPU here (torch.cuda or the CUDA driver binding is unavailable):" \
       "running the fake-driver suite instead"
  export SGLANG_USE_CPU_ENGINE=1
  exec "$PY" -m pytest -p no:cacheprovider -q "${FAKE_SUITE[@]}" "$@"
fi

echo "gpu_check: GPU 0 is $gpu"
mkdir -p "$OUT"
tests_rc=0
"$PY" -m pytest -p no:cacheprovider -q --junitxml="$OUT/gpu-tests.xml" test/gpu "${FAKE_SUITE[@]}" "$@" \
  || tests_rc=$?
for bench in "vmm_map.py --backend cuda" "weights_restore.py --backend cuda" "pool_decode.py"; do
  read -r script args <<<"$bench"
  echo "gpu_check: benchmark/micro/$script $args"
  # shellcheck disable=SC2086  # args are words
  "$PY" "benchmark/micro/$script" $args >"$OUT/${script%.py}.log" 2>&1 \
    || echo "gpu_check: $script failed (see $OUT/${script%.py}.log); its goals will read 'missing'"
done
report_rc=0
"$PY" benchmark/gpu_check_report.py --junit "$OUT/gpu-tests.xml" --results benchmark/results/micro \
  --out "$OUT/gpu_check.json" --gpu "$gpu" || report_rc=$?
[ "$tests_rc" -eq 0 ] && [ "$report_rc" -eq 0 ]
