#!/usr/bin/env bash
# Run the whole test suite: ruff (lint + format check), then unit, upstream_compat and gpu (two
# processes), then integration on CPU; gpu tests are skipped with a reason on hosts without CUDA.
#
#   scripts/test.sh [pytest args]     e.g. scripts/test.sh test/unit -x
#
# First run: builds the environment (scripts/env.sh) and converts the embedded
# model once. Server logs of integration tests land in test-logs/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=$(scripts/env.sh)
"$PY" -m sglang_memx.cli models prepare >/dev/null
export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$#" -eq 0 ]; then
  # House style first (seconds): lint and format, configured in pyproject.toml.
  "$PY" -m ruff check .
  "$PY" -m ruff format --check .
  # Unit, upstream_compat and gpu tests in two worker processes (pytest-xdist; each file stays on one
  # worker, so its module fixtures are built once), then the integration tests in one process: their
  # servers are pinned to the cores and their timings assume nothing else runs.
  # Both runs always run; the script fails if either failed.
  unit_status=0
  "$PY" -m pytest -p no:cacheprovider --durations=15 -n 2 --dist loadfile test/unit test/upstream_compat test/gpu \
    || unit_status=$?
  "$PY" -m pytest -p no:cacheprovider --durations=15 test/integration
  exit "$unit_status"
fi
exec "$PY" -m pytest -p no:cacheprovider --durations=15 "$@"
