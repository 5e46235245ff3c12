#!/usr/bin/env bash
# Build (once) the Python environment that serve.sh and test.sh use, and print
# its python on stdout (progress goes to stderr):  MEMX_PY=$(scripts/env.sh)
#
# The environment holds upstream SGLang (exact pins from requirements/lock.txt),
# the portable sgl_kernel (sgl-kernel/) and this checkout (editable).
#
# The environment lives outside the repo, in
#   ${SGLANG_MEMX_HOME:-~/.cache/sglang-memx}/envs/<hash of lock + python>/
# so a second checkout or a CI clone on the same machine reuses it. A
# half-built environment (no .complete marker) is rebuilt from scratch.
set -euo pipefail

MEMX_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEMX_HOME="${SGLANG_MEMX_HOME:-$HOME/.cache/sglang-memx}"
MEMX_UV_VERSION="0.13.8"
MEMX_BASE_PY="${MEMX_BASE_PYTHON:-python3}"

_memx_log() { printf '[memx-env] %s\n' "$*" >&2; }

# uv runs from $MEMX_BASE_PY if it has the right version, else from a small tool venv under
# $MEMX_HOME/tools (works where the system python refuses pip installs, PEP 668).
MEMX_UV_PY=""
_memx_uv() {
  if [ -z "$MEMX_UV_PY" ]; then
    local tool="$MEMX_HOME/tools/uv-$MEMX_UV_VERSION"
    if "$MEMX_BASE_PY" -m uv --version 2>/dev/null | grep -q "$MEMX_UV_VERSION"; then
      MEMX_UV_PY="$MEMX_BASE_PY"
    elif "$tool/bin/python" -m uv --version 2>/dev/null | grep -q "$MEMX_UV_VERSION"; then
      MEMX_UV_PY="$tool/bin/python"
    else
      _memx_log "installing uv $MEMX_UV_VERSION in $tool"
      rm -rf "$tool"
      "$MEMX_BASE_PY" -m venv "$tool" >&2
      "$tool/bin/python" -m pip install -q --disable-pip-version-check "uv==$MEMX_UV_VERSION" >&2
      MEMX_UV_PY="$tool/bin/python"
    fi
  fi
  # The platform's certificate store, not uv's bundled roots: where HTTPS goes through a proxy
  # whose CA is installed system-wide (pip trusts it through its config), uv's own roots fail
  # with "invalid peer certificate: UnknownIssuer" (seen on a fresh machine under `env -i`).
  UV_SYSTEM_CERTS="${UV_SYSTEM_CERTS:-1}" "$MEMX_UV_PY" -m uv "$@"
}

_memx_env_key() {
  local pyver
  pyver=$("$MEMX_BASE_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  { cat "$MEMX_REPO/requirements/lock.txt" "$MEMX_REPO/requirements/nodeps.txt"; echo "py$pyver"; } \
    | sha256sum | cut -c1-16
}

MEMX_ENV="$MEMX_HOME/envs/$(_memx_env_key)"
MEMX_PY="$MEMX_ENV/bin/python"

if [ ! -f "$MEMX_ENV/.complete" ]; then
  start=$(date +%s)
  _memx_log "building environment $MEMX_ENV (first run on this machine: several minutes)"
  rm -rf "$MEMX_ENV"
  mkdir -p "$MEMX_HOME/envs"
  _memx_uv venv -q -p "$MEMX_BASE_PY" "$MEMX_ENV"
  # Exact pins, no resolution: what the lock says is what gets installed.
  _memx_uv pip install -q -p "$MEMX_PY" --no-deps -r "$MEMX_REPO/requirements/lock.txt"
  # Packages whose own dependencies we do not want (see requirements/nodeps.txt).
  _memx_uv pip install -q -p "$MEMX_PY" --no-deps -r "$MEMX_REPO/requirements/nodeps.txt"
  echo "built $(date -u +%FT%TZ) in $(( $(date +%s) - start ))s" > "$MEMX_ENV/.complete"
  _memx_log "environment ready in $(( $(date +%s) - start ))s"
fi

# Bytecode of the environment's packages, once. Where PYTHONDONTWRITEBYTECODE is set (as on the
# machines this project runs on) no process ever caches what it compiles, and every SGLang
# scheduler (spawned with -B) compiled sglang and torch from source at each start: 1-2 min per
# server on an idle 2-core machine, many minutes under load. Files that do not compile (some
# packages ship Python 2 examples) are skipped.
if [ ! -f "$MEMX_ENV/.bytecode" ]; then
  start=$(date +%s)
  _memx_log "compiling the environment's bytecode (once)"
  site=$("$MEMX_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$MEMX_PY" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "compiled $(date -u +%FT%TZ) in $(( $(date +%s) - start ))s" > "$MEMX_ENV/.bytecode"
fi

# This checkout's packages, editable: reinstalled only when the environment points at another
# checkout or their metadata (entry points, dependencies) changed since the last install.
_memx_editable_key() {
  { echo "$MEMX_REPO"; cat "$MEMX_REPO/pyproject.toml" "$MEMX_REPO/sgl-kernel/pyproject.toml"; } | sha256sum | cut -c1-16
}
editable_key=$(_memx_editable_key)
if [ "$(cat "$MEMX_ENV/.editable" 2>/dev/null)" != "$editable_key" ]; then
  _memx_uv pip install -q -p "$MEMX_PY" --no-deps --no-build-isolation \
    -e "$MEMX_REPO/sgl-kernel" -e "$MEMX_REPO" >&2
  echo "$editable_key" > "$MEMX_ENV/.editable"
fi

echo "$MEMX_PY"
