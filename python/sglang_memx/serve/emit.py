"""Beyond one machine: the placement as upstream's model gateway config and Kubernetes manifests.

``sglang-memx serve --config models.yaml --emit gateway|k8s [--out DIR]`` validates and
places exactly as ``serve`` does, writes the artefacts and starts nothing. What upstream
documents and this module relies on is in docs/router.md, "Beyond one machine".

* ``gateway``: ``gateway.sh`` starts upstream's SGLang model gateway
  (``python3 -m sglang_router.launch_router --enable-igw ...``, its multi-model mode) and
  registers every placed model's engine with ``register_workers.py`` from ``workers.json``
  (one ``POST /workers`` body per model: ``url`` + ``model_id`` = the model's name). In
  multi-model mode the gateway does not take ``--worker-urls``; workers are registered.
* ``k8s``: one multi-document YAML. Per device holding models: a Deployment whose Pod
  runs one container per co-located model (``python3 -m sglang.launch_server`` with the
  launcher's arguments, including its memx pool flags), all containers sharing the pool
  directory (an ``emptyDir``); per model a Service; for the gateway a ConfigMap
  (workers.json, register_workers.py), a Deployment (gateway + registering sidecar) and a
  Service. A CUDA device with several models gets a ``ResourceClaimTemplate`` (dynamic
  resource allocation) so that its containers share one GPU; one model: ``nvidia.com/gpu``.

Invariants: pure functions of (config, placement, options); every placed model appears
in exactly one container, one Service and one ``workers.json`` entry; a bad option raises
``ServeConfigError`` naming it (``--namespace``, ``--image``, ``--worker-url-template``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import string
from dataclasses import dataclass
from pathlib import Path

from ..compute_share import BOARD_ENV, SHARES_ENV, SLOT_ENV
from .config import UNCAPPED, ServeConfig, ServeConfigError
from .engine_specs import _split_cores, engine_specs
from .placement import GIB, Placement

__all__ = [
    "EmitOptions",
    "ModelUnit",
    "model_units",
    "gateway_command",
    "worker_registrations",
    "gateway_files",
    "k8s_manifests",
    "k8s_files",
    "write_files",
    "emit_command",
    "REGISTER_WORKERS_PY",
]

# one host's device assignment, core binding and compute board: a container gets its own
_HOST_LOCAL_ENV = ("CUDA_VISIBLE_DEVICES", "SGLANG_CPU_OMP_THREADS_BIND", BOARD_ENV, SLOT_ENV, SHARES_ENV)
API_KEY_ENV = "MEMX_API_KEY"  # router.api_key: read from the environment, never written into an artefact
API_KEY_REF = f"$({API_KEY_ENV})"  # Kubernetes expands $(VAR) in command / args from the container's env
POOL_MOUNT = "/run/memx-pool"  # the volume every container of a device's Pod shares
# emptyDir volumes are world-writable (0777), which memx refuses for sockets: the pool
# directory is a subdirectory memx creates 0700 inside the shared volume
POOL_DIR = POOL_MOUNT + "/pools"
APP = "sglang-memx"
URL_FIELDS = ("service", "namespace", "port", "engine_port", "model", "device")


@dataclass(frozen=True)
class EmitOptions:
    """What the config does not say about a cluster. ``image``: every engine's image (None: by device kind)."""

    namespace: str = "default"
    image: str | None = None
    cpu_image: str = "sglang-memx:cpu"  # docker/Dockerfile.cpu
    gpu_image: str = "sglang-memx:gpu"  # docker/Dockerfile (upstream's image + memx; has sglang_router)
    gateway_image: str = "sglang-memx:gpu"
    worker_url_template: str = "http://{service}.{namespace}.svc:{port}"
    service_port: int = 30000
    base_engine_port: int = 31000  # model i listens on base + i inside its Pod
    gateway_policy: str = "round_robin"  # one engine per model: the policy only matters with replicas
    overhead_gb: float = 1.0  # per engine process (Python, torch, tokenizer): outside placement's model
    gpu_device_class: str = "gpu.nvidia.com"  # DRA DeviceClass of NVIDIA's DRA driver
    register_interval_s: int = 30
    api_key_secret: str = "memx-api-key"  # router.api_key set: a Secret (key ``api-key``) you create; never written

    def check(self) -> None:
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise ServeConfigError("--namespace", f"{self.namespace!r} is not a DNS label (a-z, 0-9, -; <= 63)")
        for field, value in (("--image", self.image), ("--image", self.cpu_image), ("--image", self.gpu_image),
                             ("--gateway-image", self.gateway_image)):  # fmt: skip
            if value is not None and (not value or any(c.isspace() for c in value)):
                raise ServeConfigError(field, f"{value!r} is not an image reference")
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.worker_url_template) if f is not None}
        except ValueError as exc:
            raise ServeConfigError("--worker-url-template", f"{self.worker_url_template!r}: {exc}") from None
        unknown = sorted(n for n in names if n not in URL_FIELDS)
        if unknown:
            raise ServeConfigError(
                "--worker-url-template", f"unknown placeholder {{{unknown[0]}}} (known: {', '.join(URL_FIELDS)})"
            )
        if not self.worker_url_template.startswith(("http://", "https://")):
            raise ServeConfigError("--worker-url-template", f"{self.worker_url_template!r} is not an http(s) URL")
        if not self.overhead_gb >= 0:
            raise ServeConfigError("overhead_gb", f"must be >= 0, got {self.overhead_gb!r}")


_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def _slugs(names: list[str], prefix: str) -> dict[str, str]:
    """Distinct DNS-1035 labels ``prefix + slug(name)`` (<= 63; a hash suffix when lossy names collide)."""
    base = {}
    for n in names:
        s = re.sub(r"[^a-z0-9]+", "-", n.lower()).strip("-") or "x"
        base[n] = (prefix + s)[:63].rstrip("-")
    shared = [s for s in base.values() if list(base.values()).count(s) > 1]
    return {n: f"{s[:56].rstrip('-')}-{hashlib.sha1(n.encode()).hexdigest()[:6]}" if s in shared else s
            for n, s in base.items()}  # fmt: skip


@dataclass(frozen=True)
class ModelUnit:
    """One placed model as a container: its command line, environment, port and names."""

    model: str
    device: str
    kind: str  # cpu | cuda
    container: str  # container name (DNS label)
    service: str  # its Service's name
    port: int  # the engine's port inside the Pod
    argv: tuple[str, ...]  # python3 -m sglang.launch_server ...
    env: dict
    cpus: int  # cpu: cores requested; cuda: 0
    request_bytes: int  # memory requested (cpu): weights + reserved KV + overhead
    limit_bytes: int  # memory limit (cpu): weights + the whole device pool + overhead
    path: str  # the checkpoint directory (mounted read-only at the same path)


def _set(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def model_units(config: ServeConfig, placement: Placement, opts: EmitOptions) -> list[ModelUnit]:
    """Every model, in config order, with the launcher's command line made cluster-ready:
    ``python3``, ``--host 0.0.0.0``, a fixed port, the shared pool directory of its Pod."""
    opts.check()
    for i, m in enumerate(config.models):  # one container / Service / worker per model below
        if m.min_replicas > 1:
            msg = f"{m.min_replicas}: --emit writes one engine per model; replicas are not emitted yet"
            raise ServeConfigError(f"models[{i}].min_replicas", msg)
    ports = {m.name: opts.base_engine_port + i for i, m in enumerate(config.models)}
    keyed = {"api_key": API_KEY_REF} if config.router.api_key else {}
    specs = engine_specs(config, placement, run_id="k8s", ports=ports, python="python3", **keyed)
    services = _slugs([m.name for m in config.models], "memx-")
    containers = _slugs([m.name for m in config.models], "")
    cpus = {}
    for d in config.devices:
        residents = placement.devices[d.name].models
        if d.kind == "cpu" and residents:
            shares = _split_cores(list(d.cores), len(residents)) if d.cores else [[0]] * len(residents)
            cpus.update({n: len(s) for n, s in zip(residents, shares)})
    units = []
    for m, spec in zip(config.models, specs):
        placed = placement.models[m.name]
        plan = placement.devices[placed.device]
        argv = list(spec.argv)
        _set(argv, "--host", "0.0.0.0")
        _set(argv, "--memx-pool-dir", POOL_DIR)
        env = {k: v for k, v in spec.env.items() if k not in _HOST_LOCAL_ENV}
        overhead = int(opts.overhead_gb * GIB)
        if plan.kind == "cpu":
            env["OMP_NUM_THREADS"] = str(cpus[m.name])
            request = placed.footprint_bytes + overhead
            limit = placed.size.weight_bytes + plan.pool_budget_bytes + overhead
        else:
            request = limit = 0
        units.append(ModelUnit(m.name, placed.device, plan.kind, containers[m.name] or "engine", services[m.name],
                               ports[m.name], tuple(argv), env, cpus.get(m.name, 0), request, max(request, limit),
                               m.path))  # fmt: skip
    return units


# ----------------------------------------------------------------------- the gateway


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


# ------------------------------------------------------------------------ Kubernetes


def _mi(n: int) -> str:
    return f"{max(1, math.ceil(n / (1 << 20)))}Mi"


def _labels(component: str, **extra) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component, **extra}


def _probe(port: int, period: int, failures: int) -> dict:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}  # fmt: skip


# CPU engines: OpenMP threads bound to the cores the container may run on (its cpuset).
_BIND_CORES = ('SGLANG_CPU_OMP_THREADS_BIND="$(python3 -c \'import os; '
               'print(",".join(map(str, sorted(os.sched_getaffinity(0)))))\')"; '
               'export SGLANG_CPU_OMP_THREADS_BIND; exec "$@"')  # fmt: skip


def _container(u: ModelUnit, opts: EmitOptions, startup_timeout_s: float, shared_gpu: bool) -> dict:
    image = opts.image or (opts.cpu_image if u.kind == "cpu" else opts.gpu_image)
    c = {"name": u.container, "image": image}
    if u.kind == "cpu":
        c["command"] = ["/bin/sh", "-c", _BIND_CORES, "bind-cores"]
        c["args"] = list(u.argv)
        resources = {"requests": {"cpu": str(u.cpus), "memory": _mi(u.request_bytes)},
                     "limits": {"memory": _mi(u.limit_bytes)}}  # fmt: skip
    else:
        c["command"] = list(u.argv[:3])
        c["args"] = list(u.argv[3:])
        resources = {"claims": [{"name": "gpu"}]} if shared_gpu else {"limits": {"nvidia.com/gpu": 1}}
    c["env"] = [{"name": k, "value": v} for k, v in sorted(u.env.items())] + _key_env(u.argv, opts)
    c["ports"] = [{"name": "http", "containerPort": u.port, "protocol": "TCP"}]
    c["resources"] = resources
    c["startupProbe"] = _probe(u.port, 10, max(1, math.ceil(startup_timeout_s / 10)))
    c["readinessProbe"] = _probe(u.port, 5, 3)
    c["volumeMounts"] = [{"name": "memx-pool", "mountPath": POOL_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": _model_volume(u), "mountPath": u.path, "readOnly": True}]  # fmt: skip
    return c


def _key_env(argv, opts: EmitOptions) -> list[dict]:
    """The API key from a Secret when the command line refers to it."""
    if API_KEY_REF not in argv:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": opts.api_key_secret, "key": "api-key"}}}]


def _model_volume(u: ModelUnit) -> str:
    return f"model-{hashlib.sha1(u.model.encode()).hexdigest()[:10]}"


def k8s_manifests(config: ServeConfig, placement: Placement, opts: EmitOptions) -> list[dict]:
    """Every object, in apply order: per device [ResourceClaimTemplate], Deployment; per model a
    Service; the gateway's ConfigMap, Deployment and Service."""
    units = model_units(config, placement, opts)
    ns = opts.namespace
    devices = _slugs([d.name for d in config.devices], "memx-dev-")
    docs: list[dict] = []
    for d in config.devices:
        plan = placement.devices[d.name]
        mine = [u for u in units if u.device == d.name]
        if not mine:
            continue
        sel = _labels("engine", **{"sglang-memx/device": devices[d.name].removeprefix("memx-dev-")})
        shared_gpu = d.kind == "cuda" and len(mine) > 1
        pod_spec = {
            "containers": [_container(u, opts, config.launch.startup_timeout_s, shared_gpu) for u in mine],
            "volumes": [{"name": "memx-pool", "emptyDir": {}}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
            + [{"name": _model_volume(u), "hostPath": {"path": u.path, "type": "Directory"}} for u in mine],
            "terminationGracePeriodSeconds": 60,
        }
        if shared_gpu:
            claim = f"{devices[d.name]}-gpu"
            docs.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                         "metadata": {"name": claim, "namespace": ns, "labels": sel},
                         "spec": {"spec": {"devices": {"requests": [
                             {"name": "gpu", "exactly": {"deviceClassName": opts.gpu_device_class}}]}}}})  # fmt: skip
            pod_spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": claim}]
        annotations = {"sglang-memx/device": d.name, "sglang-memx/models": json.dumps(list(plan.models)),
                       "sglang-memx/pool-budget-gb": f"{plan.pool_budget_gb:.6f}"}  # fmt: skip
        docs.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": devices[d.name], "namespace": ns, "labels": sel, "annotations": annotations},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": sel},
                     "template": {"metadata": {"labels": sel, "annotations": annotations}, "spec": pod_spec}},
        })  # fmt: skip
        for u in mine:
            docs.append({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": u.service, "namespace": ns, "labels": _labels("engine"),
                             "annotations": {"sglang-memx/model": u.model, "sglang-memx/device": d.name}},
                "spec": {"selector": sel, "ports": [{"name": "http", "port": opts.service_port,
                                                      "targetPort": u.port, "protocol": "TCP"}]},
            })  # fmt: skip
    docs += _gateway_objects(config, placement, opts)
    return docs


def _gateway_objects(config: ServeConfig, placement: Placement, opts: EmitOptions) -> list[dict]:
    ns, port = opts.namespace, config.router.port
    sel = _labels("gateway")
    workers = worker_registrations(config, placement, opts)
    meta = {"name": "memx-gateway", "namespace": ns, "labels": sel}
    cfg = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
           "data": {"workers.json": json.dumps(workers, indent=2) + "\n",
                    "register_workers.py": REGISTER_WORKERS_PY}}  # fmt: skip
    mount = [{"name": "gateway-config", "mountPath": "/etc/memx-gateway", "readOnly": True}]
    gateway = {
        "name": "gateway", "image": opts.gateway_image,
        "command": gateway_command(config, host="0.0.0.0", opts=opts)[:3],
        "args": gateway_command(config, host="0.0.0.0", opts=opts)[3:],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": 29000, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5},
    }  # fmt: skip
    if config.router.api_key:
        gateway["env"] = _key_env(gateway["args"], opts)
    register = {
        "name": "register-workers", "image": opts.gateway_image,
        "command": ["python3", "/etc/memx-gateway/register_workers.py", "--gateway", f"http://127.0.0.1:{port}",
                    "--watch", str(opts.register_interval_s), "/etc/memx-gateway/workers.json"],
        "volumeMounts": mount,
    }  # fmt: skip
    if config.router.api_key:
        register["env"] = _key_env([API_KEY_REF], opts)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": dict(meta),
        "spec": {"replicas": 1, "selector": {"matchLabels": sel},
                 "template": {"metadata": {"labels": sel}, "spec": {
                     "containers": [gateway, register],
                     "volumes": [{"name": "gateway-config", "configMap": {"name": "memx-gateway"}}]}}},
    }  # fmt: skip
    service = {"apiVersion": "v1", "kind": "Service", "metadata": dict(meta),
               "spec": {"selector": sel, "ports": [{"name": "http", "port": port, "targetPort": port,
                                                    "protocol": "TCP"}]}}  # fmt: skip
    return [cfg, deployment, service]


def k8s_files(config: ServeConfig, placement: Placement, opts: EmitOptions) -> dict[str, str]:
    import yaml

    docs = k8s_manifests(config, placement, opts)
    head = (f"# Written by `sglang-memx serve --emit k8s` from {config.source or 'a config'}: one Pod per "
            "device (its models' engines share the device's memx pool), a Service per model, upstream's "
            "model gateway.\n")  # fmt: skip

    class _Dumper(yaml.SafeDumper):  # plain YAML: no &anchors / *aliases for shared label dicts
        def ignore_aliases(self, data):
            return True

    def _str(dumper, data):  # multi-line strings (workers.json, the registrar) as readable | blocks
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    _Dumper.add_representer(str, _str)

    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
    return {"sglang-memx.yaml": head + body}


def write_files(files: dict[str, str], out: str | Path) -> list[Path]:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        p = root / name
        p.write_text(text)
        if name.endswith((".sh", ".py")):
            p.chmod(0o755)
        written.append(p)
    return written


def emit_command(config: ServeConfig, placement: Placement, args) -> int:
    """``serve --emit``: write the artefacts (exit 0), or a bad option (exit 2, naming it)."""
    import sys

    opts = EmitOptions(namespace=args.namespace, image=args.image, gateway_image=args.gateway_image,
                       worker_url_template=args.worker_url_template)  # fmt: skip
    try:
        files = (gateway_files if args.emit == "gateway" else k8s_files)(config, placement, opts)
    except ServeConfigError as exc:
        print(f"sglang-memx serve: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"sglang-memx-{args.emit}")
    for p in write_files(files, out):
        print(p)
    print(f"sglang-memx serve: placement (FineServe Alg. 1)\n{placement.describe()}\n"
          f"sglang-memx serve: wrote {len(files)} file(s) to {out}/; nothing started", file=sys.stderr)  # fmt: skip
    return 0


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
