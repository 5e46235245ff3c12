#!/usr/bin/env bash
# Serve the embedded SmolLM2-135M-Instruct on this machine's CPU through
# upstream `python -m sglang.launch_server`, with memx's memory features on:
# elastic KV (KV and activations in one pool, mapped as pages are used) and the
# CPU elastic buffer (KV of waiting requests parked on the host).
#
#   scripts/serve.sh [extra launch_server flags, e.g. --memx-status-path /x]
#   scripts/serve.sh --memx-disable     # stock SGLang behaviour, plugin loaded but idle
#
# First run: builds the environment (scripts/env.sh) and converts the model once.
# Env: MEMX_HOST (127.0.0.1), MEMX_PORT (30000), MEMX_MAX_TOTAL_TOKENS (16384),
#      MEMX_FEATURES (the memx flags, default below; empty for none).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=$(scripts/env.sh)
MODEL=$("$PY" -m sglang_memx.cli models prepare)
HOST="${MEMX_HOST:-127.0.0.1}"
PORT="${MEMX_PORT:-30000}"
URL="http://$HOST:$PORT"
NAME="SmolLM2-135M-Instruct"
# The default memx features (test/integration/test_serving_embedded.py serves with the same flags).
MEMX_FEATURES="${MEMX_FEATURES-"--memx-elastic-kv --memx-host-buffer-gb 1"}"
for arg in "$@"; do
  if [ "$arg" = "--memx-disable" ]; then MEMX_FEATURES=""; fi  # stock behaviour: no feature flags
done

# Print working examples once the server answers /health.
(
  "$PY" - "$URL" "$NAME" <<'PYEOF'
import sys, time, urllib.request
url, name = sys.argv[1], sys.argv[2]
for _ in range(1800):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        time.sleep(1)
else:
    sys.exit(0)
print(f"""
================ sglang-memx is serving {name} at {url} ================
curl:
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'
openai client (python):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="none")
  r = client.chat.completions.create(model="{name}", temperature=0, max_tokens=32,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}])
  print(r.choices[0].message.content)
memx status (pool, mapped vs logical KV, host buffer, hooks in force):
  curl -s {url}/memx/status
  {sys.executable} -m sglang_memx.cli status --url {url}
Prometheus metrics:
  curl -s {url}/memx/metrics
=====================================================================
""", flush=True)
PYEOF
) &

export SGLANG_USE_CPU_ENGINE=1
exec "$PY" -m sglang.launch_server \
  --model-path "$MODEL" --served-model-name "$NAME" \
  --device cpu --attention-backend torch_native \
  --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled \
  --max-total-tokens "${MEMX_MAX_TOTAL_TOKENS:-16384}" \
  --host "$HOST" --port "$PORT" $MEMX_FEATURES "$@"
