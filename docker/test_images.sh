#!/usr/bin/env bash
# Build the CPU image (docker/Dockerfile.cpu) and smoke-test it:
#   1. the default command (scripts/serve.sh: the router, `sglang-memx serve`, with the embedded
#      SmolLM2-135M-Instruct and its float32 copy on one shared memx pool, elastic KV and the host
#      buffer on): router and both engines up, /v1/models lists both, one chat completion per
#      model, each engine's GET /memx/status through the router (/models/<name>/memx/status)
#      with the shared pool on;
#   2. upstream's own command line, `python3 -m sglang.launch_server ...`, given to
#      `docker run` unchanged (the drop-in promise): server up, one chat completion,
#      GET /memx/status;
#   3. `sglang-memx version` and `python3` resolve to the image's locked environment.
# Prints the build time, the smoke-test time, the image size and its largest layers; logs go to
# test-logs/docker-images/ (summary.txt has the figures, history.txt every layer's size).
#
#   docker/test_images.sh
#
# Docker engine: the one `docker info` reaches (DOCKER_HOST or the default socket). If there is
# none and this runs as root, the script starts a private dockerd (installing Debian's docker.io
# with apt-get if needed) with its own data root, exec root and socket under a temporary
# directory, without iptables or a bridge (builds and containers use the host network), and
# stops it and removes the directory at the end.
#
# Base image: MEMX_DOCKER_BASE if set; else python:3.11-slim-bookworm (Dockerfile.cpu's
# default) if it can be pulled; else a Debian bookworm base is built here from the
# distribution's packages (debootstrap from the host's apt mirror, with python3, venv, pip
# and CA certificates) and imported as local/memx-base:bookworm. That base carries this
# host's CA bundle (an egress proxy may need it): NEVER PUSH an image built on it.
#
# Environment:
#   MEMX_IMAGE             tag to build (default sglang-memx:cpu-test)
#   MEMX_DOCKER_BASE       base image for the build (skips the pull / debootstrap)
#   MEMX_DEBIAN_MIRROR     mirror for debootstrap (default: the host's apt mirror)
#   MEMX_DOCKER_DATA_ROOT  data root of the private dockerd, kept afterwards (layer cache
#                          for the next run); default: a temporary directory, removed
#   MEMX_TEST_PORT         first of the two host ports the servers use (default 30180)
#   MEMX_TEST_TIMEOUT      seconds a server may take to answer /health (default 900)
#   MEMX_REMOVE_IMAGE=1    remove the image afterwards from an engine that outlives the script
#   MEMX_TEST_LOG_DIR      where logs go (default test-logs/docker-images)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${MEMX_IMAGE:-sglang-memx:cpu-test}"
PORT="${MEMX_TEST_PORT:-30180}"
TIMEOUT="${MEMX_TEST_TIMEOUT:-900}"
LOG_DIR="${MEMX_TEST_LOG_DIR:-$REPO/test-logs/docker-images}"
MODEL_DIR=/opt/memx-home/models/SmolLM2-135M-Instruct-bf16  # where Dockerfile.cpu converts it
MODEL_NAME=SmolLM2-135M-Instruct
ROUTER_MODELS="$MODEL_NAME,$MODEL_NAME-fp32"  # what scripts/serve.sh serves behind its router
LOCAL_BASE=local/memx-base:bookworm

WORK=""          # temporary directory (private dockerd, rootfs), removed at exit
DOCKERD_PID=""   # the private dockerd, if this script started one
CONTAINERS=()    # containers this script started

log() { printf '[test_images] %s\n' "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

mkdir -p "$LOG_DIR"
: >"$LOG_DIR/summary.txt"
note() {
  log "$*"
  printf '%s\n' "$*" >>"$LOG_DIR/summary.txt"
}

# Unmount whatever is still mounted below $1 (deepest first): nothing under a temporary
# directory may be mounted when it is removed.
unmount_below() {
  local m
  awk -v root="$1" '$2 == root || index($2, root "/") == 1 {print $2}' /proc/mounts | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
}

cleanup() {
  local rc=$? c pid
  trap - EXIT INT TERM
  for c in "${CONTAINERS[@]}"; do docker rm -f "$c" >/dev/null 2>&1 || true; done
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping the private dockerd (pid $DOCKERD_PID)"
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
    # Its containerd and shims, if any outlived it (they run from our exec root).
    for pid in $(pgrep -f -- "$WORK/" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
  elif [ "${MEMX_REMOVE_IMAGE:-0}" = 1 ] && [ -n "${BUILT:-}" ]; then
    docker rmi -f "$IMAGE" >/dev/null 2>&1 || true
  fi
  if [ -n "$WORK" ] && [ -d "$WORK" ]; then
    unmount_below "$WORK"
    [ -n "${MEMX_DOCKER_DATA_ROOT:-}" ] && unmount_below "$MEMX_DOCKER_DATA_ROOT"
    rm -rf --one-file-system "$WORK" || log "could not remove $WORK entirely"
  fi
  if [ "$rc" -eq 0 ]; then log "PASSED"; else log "exit status $rc (logs in $LOG_DIR)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

command -v python3 >/dev/null || die "python3 is needed on the host (HTTP checks)"

apt_install() {
  command -v apt-get >/dev/null || die "$* not installed and no apt-get to install it"
  log "installing $* from the distribution's packages"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Short path: dockerd's and containerd's unix sockets live under it (108-byte limit).
WORK="$(mktemp -d /tmp/memx-docker.XXXXXX)"

# ---------------------------------------------------------------- 1. a Docker engine
ENGINE=""
if docker info >/dev/null 2>&1; then
  ENGINE="existing engine (${DOCKER_HOST:-default socket}), server $(docker version -f '{{.Server.Version}}')"
else
  [ "$(id -u)" = 0 ] || die "no Docker engine reachable (docker info) and not root, so none can be started"
  command -v dockerd >/dev/null || apt_install docker.io
  command -v docker >/dev/null || apt_install docker.io
  data_root="${MEMX_DOCKER_DATA_ROOT:-$WORK/data}"
  mkdir -p "$data_root" "$WORK/exec"
  log "starting a private dockerd (data root $data_root)"
  dockerd --iptables=false --ip6tables=false --bridge=none \
    --data-root "$data_root" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    -H "unix://$WORK/docker.sock" >"$LOG_DIR/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  export DOCKER_HOST="unix://$WORK/docker.sock"
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || die "dockerd exited at start (see $LOG_DIR/dockerd.log)"
    sleep 1
  done
  docker info >/dev/null 2>&1 || die "dockerd did not answer within 120 s (see $LOG_DIR/dockerd.log)"
  ENGINE="private dockerd $(docker version -f '{{.Server.Version}}') started by this script, storage $(docker info -f '{{.Driver}}')"
fi
note "engine: $ENGINE"
note "host: $(uname -m), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"

# ---------------------------------------------------------------- 2. a base image
host_mirror() {
  # The first Debian archive the host's apt already uses (deb822 or one-line format).
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri=$(awk 'tolower($1) == "uris:" && $2 !~ /security/ {print $2; exit}' "$f")
    [ -n "$uri" ] && { echo "$uri"; return; }
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' "$f")
    [ -n "$uri" ] && { echo "$uri"; return; }
  done
  echo "http://deb.debian.org/debian"
}

host_ca_bundle() {
  local f
  for f in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    [ -n "$f" ] && [ -s "$f" ] && { echo "$f"; return; }
  done
}

build_local_base() {
  local mirror rootfs ca t0
  t0=$(date +%s)
  command -v debootstrap >/dev/null || apt_install debootstrap
  mirror="${MEMX_DEBIAN_MIRROR:-$(host_mirror)}"
  rootfs="$WORK/rootfs"
  log "building $LOCAL_BASE with debootstrap from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$LOG_DIR/debootstrap.log" 2>&1 ||
    die "debootstrap failed (see $LOG_DIR/debootstrap.log)"
  unmount_below "$rootfs"
  ca="$(host_ca_bundle)"
  if [ -n "$ca" ]; then
    # pip and uv inside the build verify PyPI against this bundle; the copy under
    # /usr/local/share keeps it when a later package runs update-ca-certificates.
    cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    cp "$ca" "$rootfs/usr/local/share/ca-certificates/memx-host-bundle.crt"
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' \
    -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'CMD ["bash"]' \
    -m "debootstrap bookworm minbase from $mirror with this host's CA bundle; do not push" \
    - "$LOCAL_BASE" >/dev/null
  rm -rf --one-file-system "$rootfs"
  note "base: $LOCAL_BASE built from Debian packages in $(($(date +%s) - t0)) s (NOT for pushing: host CA bundle inside)"
}

BASE="${MEMX_DOCKER_BASE:-}"
if [ -z "$BASE" ]; then
  default_base=python:3.11-slim-bookworm
  if docker image inspect "$default_base" >/dev/null 2>&1 ||
    timeout 180 docker pull -q "$default_base" >/dev/null 2>&1; then
    BASE="$default_base"
    note "base: $BASE (pulled)"
  elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    BASE="$LOCAL_BASE"
    note "base: $BASE (already in this engine; NOT for pushing: host CA bundle inside)"
  else
    log "cannot pull $default_base; building a base from the distribution's packages"
    BASE="$LOCAL_BASE"
    build_local_base
  fi
else
  note "base: $BASE (MEMX_DOCKER_BASE)"
fi

# ---------------------------------------------------------------- 3. build
if docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-1}"
else
  export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"  # no buildx: the classic builder
fi
log "building $IMAGE from docker/Dockerfile.cpu (BuildKit=$DOCKER_BUILDKIT; log: $LOG_DIR/build.log)"
t0=$(date +%s)
build_args=(-f "$REPO/docker/Dockerfile.cpu" --network host --build-arg "BASE=$BASE" -t "$IMAGE")
[ "$DOCKER_BUILDKIT" = 1 ] && build_args+=(--progress plain)
if ! docker build "${build_args[@]}" "$REPO" >"$LOG_DIR/build.log" 2>&1; then
  tail -n 40 "$LOG_DIR/build.log" >&2
  die "docker build failed (see $LOG_DIR/build.log)"
fi
BUILT=1
build_s=$(($(date +%s) - t0))
size_b=$(docker image inspect -f '{{.Size}}' "$IMAGE")
note "build: $IMAGE in ${build_s} s"
note "image size: $(python3 -c "import sys; print(f'{int(sys.argv[1]) / 1e9:.2f} GB ({int(sys.argv[1])} bytes)')" "$size_b")"
# Where the size is: every layer (docker history, bytes) in history.txt, the three largest here.
docker history --human=false --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" >"$LOG_DIR/history.txt" 2>&1 || true
note "largest layers: $(sort -rn "$LOG_DIR/history.txt" | head -n 3 |
  awk -F'\t' '{sub(/^\/bin\/sh -c (#\(nop\) )?/, "", $2); printf "%s%.2f GB %s", (NR > 1 ? "; " : ""), $1 / 1e9, substr($2, 1, 60)}')"

# ---------------------------------------------------------------- 4. smoke tests
# check_server URL NAMES TIMEOUT CONTAINER: wait for /health, then one chat completion per model
# and its memx status; prints one line. One name: a single server (GET /memx/status); several
# (comma-separated): scripts/serve.sh's router (GET /v1/models lists them; each engine's status
# through the router's /models/<name>/memx/status, with the shared pool on).
check_server() {
  python3 - "$@" <<'PYEOF'
import json, subprocess, sys, time, urllib.request

url, names, timeout, cname = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), sys.argv[4]
router = len(names) > 1
t0 = time.monotonic()
while True:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() - t0 > timeout:
        sys.exit(f"{cname}: /health did not answer within {timeout:.0f} s")
    state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cname],
                           capture_output=True, text=True).stdout.strip()
    if state != "true":
        sys.exit(f"{cname}: the container stopped before the server answered")
    time.sleep(2)
up_s = time.monotonic() - t0
if router:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        listed = sorted(m["id"] for m in json.load(r)["data"])
    assert listed == sorted(names), f"/v1/models lists {listed}, expected {names}"
parts = []
for name in names:
    body = json.dumps({"model": name, "temperature": 0, "max_tokens": 24,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        chat = json.load(r)
    chat_s = time.monotonic() - t
    answer = chat["choices"][0]["message"]["content"]
    assert isinstance(answer, str) and answer.strip(), f"{name}: empty answer: {chat}"
    status_url = url + (f"/models/{name}/memx/status" if router else "/memx/status")
    with urllib.request.urlopen(status_url, timeout=30) as r:
        status = json.load(r)
    assert status.get("enabled") is True, f"{status_url}: memx not enabled: {status}"
    features = status["schedulers"][0]["features"]
    if router:
        assert features.get("shared_pool") is True, f"{status_url}: not on the shared pool: {features}"
    on = sorted(k for k, v in features.items() if v is True)
    parts.append(f"{name}: chat {chat_s:.1f} s -> {answer.strip()!r}; memx status features on: {', '.join(on)}")
print(f"up in {up_s:.0f} s; " + "; ".join(parts))
PYEOF
}

run_server() {  # run_server NAME PORT [command...]: start a container on the host network
  local name="$1" port="$2"
  shift 2
  CONTAINERS+=("$name")
  docker rm -f "$name" >/dev/null 2>&1 || true
  docker run -d --name "$name" --network host --shm-size 2g \
    -e MEMX_HOST=127.0.0.1 -e "MEMX_PORT=$port" "$IMAGE" "$@" >/dev/null
}

finish_server() {  # finish_server NAME: keep its log, remove it
  docker logs "$1" >"$LOG_DIR/$1.log" 2>&1 || true
  docker rm -f "$1" >/dev/null 2>&1 || true
}

t0=$(date +%s)
cid="memx-smoke-serve-$$"
log "smoke 1: default command (scripts/serve.sh) on port $PORT"
run_server "$cid" "$PORT"
if ! out=$(check_server "http://127.0.0.1:$PORT" "$ROUTER_MODELS" "$TIMEOUT" "$cid"); then
  finish_server "$cid"
  tail -n 30 "$LOG_DIR/$cid.log" >&2
  die "smoke 1 (see $LOG_DIR/$cid.log)"
fi
finish_server "$cid"
note "smoke 1, default command (scripts/serve.sh, router + 2 models): $out"

port2=$((PORT + 1))
cid="memx-smoke-upstream-cmd-$$"
log "smoke 2: upstream's command line, python3 -m sglang.launch_server, on port $port2"
run_server "$cid" "$port2" python3 -m sglang.launch_server \
  --model-path "$MODEL_DIR" --served-model-name "$MODEL_NAME" \
  --device cpu --attention-backend torch_native \
  --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled \
  --max-total-tokens 16384 --host 127.0.0.1 --port "$port2" --memx-elastic-kv
if ! out=$(check_server "http://127.0.0.1:$port2" "$MODEL_NAME" "$TIMEOUT" "$cid"); then
  finish_server "$cid"
  tail -n 30 "$LOG_DIR/$cid.log" >&2
  die "smoke 2 (see $LOG_DIR/$cid.log)"
fi
finish_server "$cid"
note "smoke 2, docker run IMAGE python3 -m sglang.launch_server ... --memx-elastic-kv: $out"

log "smoke 3: the environment on PATH"
prefix=$(docker run --rm "$IMAGE" python3 -c 'import sys, sglang, sglang_memx; print(sys.prefix)') ||
  die "python3 in the image cannot import sglang and sglang_memx"
case "$prefix" in
  /opt/memx-env | /opt/memx-home/envs/*) ;;
  *) die "python3 in the image is not the locked environment (sys.prefix=$prefix)" ;;
esac
version=$(docker run --rm "$IMAGE" sglang-memx version 2>&1) || die "sglang-memx version failed: $version"
printf '%s\n' "$version" >"$LOG_DIR/sglang-memx-version.txt"
note "smoke 3: python3 -> $prefix; sglang-memx version: $(printf '%s' "$version" | tr '\n' ' ' | cut -c1-200)"
note "smoke tests: $(($(date +%s) - t0)) s"
