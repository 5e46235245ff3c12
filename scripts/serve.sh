#!/usr/bin/env bash
# Serve two co-located models on this machine's CPU behind one OpenAI-compatible router,
# memx's memory features on: `sglang-memx serve` (docs/router.md) with
#   SmolLM2-135M-Instruct       the embedded model, bfloat16 (KV: 23,040 B per token)
#   SmolLM2-135M-Instruct-fp32  its float32 copy, widened offline (KV: 46,080 B per token)
# on one CPU device sharing one memx pool and its cores (each engine starts on a core of its own
# and computes on both while the other has no work: docs/router.md, "Idle cores"): elastic KV (KV and activations
# mapped as pages are used, from one budget for both models) and the CPU elastic buffer
# (KV of waiting requests parked on the host). Prints working examples for both models once
# the router and both engines answer.
#
#   scripts/serve.sh [extra launch_server flags for every engine, e.g. --chunked-prefill-size 512]
#   scripts/serve.sh --single [launch_server flags]  # the embedded model alone, upstream's own
#                                                    # `python -m sglang.launch_server` command line
#   scripts/serve.sh --memx-disable                  # stock SGLang: --single with the plugin idle
#
# First run: builds the environment (scripts/env.sh) and converts the models once.
# Env: MEMX_HOST (127.0.0.1), MEMX_PORT (30000), MEMX_MAX_TOTAL_TOKENS (16384 per model),
#      MEMX_FEATURES (memx flags; default below; empty for none; in router mode elastic KV
#      and the shared pool are always on and the rest goes to every engine),
#      MEMX_MEMORY_GB (2: the device's memory for both models' weights + the shared pool),
#      MEMX_LOG_DIR (engine logs; default $SGLANG_MEMX_HOME/serve/logs-<port>),
#      MEMX_CONFIG (where the generated models.yaml goes; default $SGLANG_MEMX_HOME/serve/models-<port>.yaml),
#      MEMX_DRY_RUN=1 (print the command instead of running it).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=$(scripts/env.sh)
HOST="${MEMX_HOST:-127.0.0.1}"
PORT="${MEMX_PORT:-30000}"
NAME="SmolLM2-135M-Instruct"
# The default memx features (test/integration/test_serving_embedded.py checks them).
MEMX_FEATURES="${MEMX_FEATURES-"--memx-elastic-kv --memx-host-buffer-gb 1"}"
SINGLE=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --single) SINGLE=1 ;;
    --memx-disable) SINGLE=1; MEMX_FEATURES=""; ARGS+=("$arg") ;;  # stock: one upstream server, no feature flag
    *) ARGS+=("$arg") ;;
  esac
done
# The address the examples use (a server on every interface is reached on loopback here).
case "$HOST" in 0.0.0.0 | :: | "[::]") LOCAL=127.0.0.1 ;; *) LOCAL="$HOST" ;; esac
URL="http://$LOCAL:$PORT"

if [ "$SINGLE" = 1 ]; then
  MODEL=$("$PY" -m sglang_memx.cli models prepare)
  # shellcheck disable=SC2206  # MEMX_FEATURES is a list of flags
  CMD=("$PY" -m sglang.launch_server
    --model-path "$MODEL" --served-model-name "$NAME"
    --device cpu --attention-backend torch_native
    --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled
    --max-total-tokens "${MEMX_MAX_TOTAL_TOKENS:-16384}"
    --host "$HOST" --port "$PORT" $MEMX_FEATURES ${ARGS[@]+"${ARGS[@]}"})
  MODELS="$NAME"
else
  SERVE_CFG=(--host "$HOST" --port "$PORT" --max-total-tokens "${MEMX_MAX_TOTAL_TOKENS:-16384}"
    --memory-gb "${MEMX_MEMORY_GB:-2}" --memx-args="$MEMX_FEATURES")
  [ -n "${MEMX_LOG_DIR:-}" ] && SERVE_CFG+=(--log-dir "$MEMX_LOG_DIR")
  [ -n "${MEMX_CONFIG:-}" ] && SERVE_CFG+=(--out "$MEMX_CONFIG")
  CONFIG=$("$PY" -m sglang_memx.cli models serve-config "${SERVE_CFG[@]}" -- ${ARGS[@]+"${ARGS[@]}"})
  CMD=("$PY" -m sglang_memx.cli serve --config "$CONFIG")
  MODELS="$NAME $NAME-fp32"
fi

if [ "${MEMX_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  printf '\n'
  exit 0
fi

# Print working examples once every model answers: the router's /health is 200 only when
# every engine is up. The printer gives up when this script's process (the server, after
# exec) is gone.
(
  "$PY" - "$URL" "$$" "$SINGLE" $MODELS <<'PYEOF'
import json, os, sys, time, urllib.request
url, server_pid, single, names = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
QUESTION = "What is the capital of France?"
while True:
    try:
        os.kill(server_pid, 0)
    except ProcessLookupError:
        sys.exit(0)
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    time.sleep(1)


def ask(name):
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": QUESTION}],
                       "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return "answered: " + json.dumps(json.load(r)["choices"][0]["message"]["content"])
    except Exception as exc:  # the example is printed anyway
        return f"did not answer yet: {exc}"


what = f"{names[0]}" if single else f"{len(names)} models on one shared memx pool ({', '.join(names)})"
out = [f"\n================ sglang-memx is serving {what} at {url} ================"]
for name in names:
    out += [
        f"--- {name} ({ask(name)})",
        "curl:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"""    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "{QUESTION}"}}], "max_tokens": 32, "temperature": 0}}'""",
    ]
out += [
    "openai client (python):",
    "  from openai import OpenAI",
    f'  client = OpenAI(base_url="{url}/v1", api_key="none")',
    f"  for model in {names!r}:",
    "      r = client.chat.completions.create(model=model, temperature=0, max_tokens=32,",
    f'            messages=[{{"role": "user", "content": "{QUESTION}"}}])',
    "      print(model, r.choices[0].message.content)",
]
if single:
    out += [
        "memx status (pool, mapped vs logical KV, host buffer, hooks in force):",
        f"  curl -s {url}/memx/status",
        f"  {sys.executable} -m sglang_memx.cli status --url {url}",
        "Prometheus metrics:",
        f"  curl -s {url}/memx/metrics",
    ]
else:
    out += ["models and engines: curl -s " + url + "/v1/models ; curl -s " + url + "/memx/serve",
            "memx status of each engine (its KV, the shared pool, host buffer, hooks in force):"]
    out += [f"  curl -s {url}/models/{name}/memx/status" for name in names]
    out += [
        "native API / frontend language: POST " + url + f"/models/<model>/generate ; "
        f'sgl.RuntimeEndpoint("{url}/models/{names[0]}")',
        f"live view: {sys.executable} -m sglang_memx.cli top --router {url}",
        f"Prometheus metrics: curl -s {url}/metrics (router) ; curl -s {url}/models/<model>/memx/metrics (engine)",
    ]
out.append("=" * 80 + "\n")
print("\n".join(out), flush=True)
PYEOF
) &

export SGLANG_USE_CPU_ENGINE=1
exec "${CMD[@]}"
