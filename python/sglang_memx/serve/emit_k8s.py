"""Kubernetes manifests for the placement (``--emit k8s``): per device a Deployment whose Pod
holds its models' engines over one shared pool directory, per model a Service, and the gateway
(ConfigMap, Deployment with the registering sidecar, Service)."""

from __future__ import annotations

import hashlib
import json
import math

from .config import ServeConfig
from .emit_gateway import REGISTER_WORKERS_PY, gateway_command, worker_registrations
from .emit_units import API_KEY_ENV, API_KEY_REF, APP, POOL_MOUNT, EmitOptions, ModelUnit, _slugs, model_units
from .placement import Placement


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
