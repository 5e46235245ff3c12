"""Upstream's model gateway in multi-model mode in front of the emitted engines (``--emit gateway``):
its command line, the ``POST /workers`` bodies and the stdlib-only registrar script."""

from __future__ import annotations

import json
import math
import shlex

from .config import UNCAPPED, ServeConfig
from .emit_units import API_KEY_ENV, API_KEY_REF, EmitOptions, ModelUnit, model_units
from .placement import Placement


def _url(unit: ModelUnit, opts: EmitOptions) -> str:
    return opts.worker_url_template.format(service=unit.service, namespace=opts.namespace, port=opts.service_port,
                                           engine_port=unit.port, model=unit.model, device=unit.device)  # fmt: skip


def gateway_command(config: ServeConfig, host: str | None = None, opts: EmitOptions | None = None,
                    key_ref: str = API_KEY_REF) -> list[str]:  # fmt: skip
    """``python3 -m sglang_router.launch_router`` in multi-model (IGW) mode with the router's limits.

    ``--max-concurrent-requests``: the sum of every model's in-flight cap (the gateway's
    limit is global; left to the gateway when a model has none); ``--queue-size``:
    ``router.max_queued`` (a FIFO, not EDF; left out when unset); with
    ``router.api_key``: ``--api-key`` + ``key_ref`` (a reference to the key, not the key).
    """
    opts = opts or EmitOptions()
    caps = [config.inflight_cap(m) for m in config.models]
    limits = [] if UNCAPPED in caps else ["--max-concurrent-requests", str(sum(caps))]  # else the gateway's own
    if config.router.max_queued is not None:
        limits += ["--queue-size", str(config.router.max_queued)]
    return ["python3", "-m", "sglang_router.launch_router", "--enable-igw",
            "--host", host or config.router.host, "--port", str(config.router.port),
            "--policy", opts.gateway_policy,
            "--request-timeout-secs", str(math.ceil(config.router.request_timeout_s))] + limits + (
        ["--api-key", key_ref] if config.router.api_key else [])  # fmt: skip


def worker_registrations(config: ServeConfig, placement: Placement, opts: EmitOptions) -> list[dict]:
    """One ``POST /workers`` body per model: url, model_id (= served model name), labels."""
    out = []
    for u in model_units(config, placement, opts):
        m = config.model(u.model)
        labels = {"memx.device": u.device, "memx.priority": str(m.priority), "memx.ttft_slo_ms": f"{m.ttft_slo_ms:g}"}
        out.append({"url": _url(u, opts), "model_id": u.model, "worker_type": "regular", "labels": labels})
    return out


def gateway_files(config: ServeConfig, placement: Placement, opts: EmitOptions) -> dict[str, str]:
    """``gateway.sh``, ``workers.json``, ``register_workers.py``."""
    workers = worker_registrations(config, placement, opts)
    cmd = gateway_command(config, opts=opts, key_ref="__KEY__")
    gw = f"http://{_connect_host(config.router.host)}:{config.router.port}"
    script = "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by `sglang-memx serve --emit gateway` from {config.source or 'a config'}.",
        "# Upstream's SGLang model gateway in multi-model mode (--enable-igw) in front of the engines",
        "# of workers.json (one per model, model_id = the model's name), registered once it answers.",
        "# Needs `sglang-router` (pip install sglang-router; upstream's GPU image has it).",
        "set -euo pipefail",
        'here="$(cd "$(dirname "$0")" && pwd)"',
        *([f': "${{{API_KEY_ENV}:?router.api_key is set: export {API_KEY_ENV} (the key of the engines)}}"']
          if config.router.api_key else []),
        shlex.join(cmd).replace("__KEY__", f'"${API_KEY_ENV}"') + " &",
        "gateway=$!",
        'trap \'kill "$gateway" 2>/dev/null || true\' EXIT',
        f'python3 "$here/register_workers.py" --gateway {shlex.quote(gw)} "$here/workers.json"',
        'wait "$gateway"',
        "",
    ])  # fmt: skip
    return {"gateway.sh": script, "workers.json": json.dumps(workers, indent=2) + "\n",
            "register_workers.py": REGISTER_WORKERS_PY}  # fmt: skip


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)


# The registrar: stdlib only, so that it runs in any image that has python3.
REGISTER_WORKERS_PY = '''\
#!/usr/bin/env python3
"""Register engines with an SGLang model gateway in multi-model mode (POST /workers).

usage: register_workers.py --gateway URL [--watch SECONDS] [--timeout SECONDS] workers.json

workers.json: a list of POST /workers bodies ({"url", "model_id", ...}). Waits until the
gateway answers GET /workers, then posts every body whose url the gateway does not list.
--watch N: keep doing that every N seconds (a restarted gateway gets its workers back).
MEMX_API_KEY in the environment: sent as a bearer token and as each worker's api_key.
Exit status without --watch: 0 once every worker is accepted, 1 on timeout.
Written by sglang-memx (serve --emit).
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def listed(gateway):
    with urllib.request.urlopen(urllib.request.Request(gateway + "/workers", headers=_headers()), timeout=10) as r:
        return {w.get("url", "").rstrip("/") for w in json.load(r).get("workers", [])}


KEY = os.environ.get("MEMX_API_KEY")  # set: the engines' --api-key, sent to the gateway and given per worker


def _headers():
    return {"Authorization": "Bearer " + KEY} if KEY else {}


def post(gateway, body):
    body = {**body, "api_key": KEY} if KEY else body
    req = urllib.request.Request(gateway + "/workers", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **_headers()})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def once(gateway, workers):
    """Post what is missing; True when every worker is listed or was just accepted."""
    try:
        have = listed(gateway)
    except (OSError, ValueError) as exc:
        print(f"register_workers: gateway {gateway} not answering: {exc}", file=sys.stderr, flush=True)
        return False
    ok = True
    for body in workers:
        if body["url"].rstrip("/") in have:
            continue
        try:
            status = post(gateway, body)
            print(f"register_workers: {body['model_id']} at {body['url']}: HTTP {status}", flush=True)
        except urllib.error.HTTPError as exc:
            ok = False
            print(f"register_workers: {body['model_id']}: HTTP {exc.code} {exc.read()[:200]!r}", file=sys.stderr)
        except OSError as exc:
            ok = False
            print(f"register_workers: {body['model_id']}: {exc}", file=sys.stderr, flush=True)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--watch", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("workers")
    args = ap.parse_args(argv)
    with open(args.workers) as f:
        workers = json.load(f)
    gateway = args.gateway.rstrip("/")
    deadline = time.monotonic() + args.timeout
    while True:
        done = once(gateway, workers)
        if args.watch is None and done:
            return 0
        if args.watch is None and time.monotonic() > deadline:
            print("register_workers: timed out", file=sys.stderr)
            return 1
        time.sleep(args.watch if args.watch is not None else 2.0)


if __name__ == "__main__":
    sys.exit(main())
'''
