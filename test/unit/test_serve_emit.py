"""``sglang-memx serve --emit gateway|k8s``: the artefacts parse, match minimal schemas, and say
what the placement says (nothing is started; no cluster, no gateway process).

The Kubernetes schemas below are this project's own minimal JSON schemas of the fields the
emitter writes (apps/v1 Deployment, v1 Service, v1 ConfigMap, resource.k8s.io/v1
ResourceClaimTemplate), closed (``additionalProperties: false``) so that a misspelt field
fails; the cross-object rules (selectors, ports, volumes, claims) are checked in Python.
The worker-registration schema follows upstream's ``WorkerConfigRequest`` (the body of the
gateway's ``POST /workers``, sgl-model-gateway/src/protocols/worker_spec.rs).
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace

import jsonschema
import pytest
import yaml

from sglang_memx.serve import emit
from sglang_memx.serve.config import ServeConfigError, parse_config
from sglang_memx.serve.launcher import engine_specs
from sglang_memx.serve.placement import plan_placement
from support.fake_checkpoint import fake_model
from support.http_stub import serving

# ------------------------------------------------------------------ minimal schemas

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}

LABELS = {"type": "object", "additionalProperties": {"type": "string", "pattern": LABEL_VALUE}}
META = {
    "type": "object", "required": ["name", "namespace"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "pattern": DNS1123_LABEL}, "namespace": {"type": "string"},
                   "labels": LABELS, "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
}  # fmt: skip
QUANTITIES = {"type": "object", "additionalProperties": {
    "anyOf": [{"type": "string", "pattern": QUANTITY}, {"type": "integer", "minimum": 0}]}}  # fmt: skip
PROBE = {
    "type": "object", "required": ["httpGet"], "additionalProperties": False,
    "properties": {"httpGet": {"type": "object", "required": ["path", "port"], "additionalProperties": False,
                               "properties": {"path": {"type": "string", "pattern": "^/"}, "port": PORT}},
                   "periodSeconds": {"type": "integer", "minimum": 1},
                   "timeoutSeconds": {"type": "integer", "minimum": 1},
                   "failureThreshold": {"type": "integer", "minimum": 1}},
}  # fmt: skip
SECRET_KEY = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "pattern": DNS1123_LABEL},
                             "key": {"type": "string"}}}  # fmt: skip
SECRET_REF = {"type": "object", "required": ["secretKeyRef"], "additionalProperties": False,
              "properties": {"secretKeyRef": SECRET_KEY}}  # fmt: skip
ENV_VAR = {"type": "object", "required": ["name"], "additionalProperties": False,
           "oneOf": [{"required": ["value"]}, {"required": ["valueFrom"]}],
           "properties": {"name": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
                          "value": {"type": "string"}, "valueFrom": SECRET_REF}}  # fmt: skip
CONTAINER_PORT = {"type": "object", "required": ["containerPort"], "additionalProperties": False,
                  "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9-]{1,15}$"}, "containerPort": PORT,
                                 "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}  # fmt: skip
CLAIM_REF = {"type": "object", "required": ["name", "resourceClaimTemplateName"], "additionalProperties": False,
             "properties": {"name": {"type": "string"}, "resourceClaimTemplateName": {"type": "string"}}}  # fmt: skip
CONTAINER = {
    "type": "object", "required": ["name", "image"], "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": DNS1123_LABEL},
        "image": {"type": "string", "pattern": r"^\S+$"},
        "command": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": ENV_VAR},
        "ports": {"type": "array", "items": CONTAINER_PORT},
        "resources": {"type": "object", "additionalProperties": False,
                      "properties": {"requests": QUANTITIES, "limits": QUANTITIES,
                                     "claims": {"type": "array", "items": {"type": "object", "required": ["name"]}}}},
        "startupProbe": PROBE, "readinessProbe": PROBE,
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"],
                                                     "additionalProperties": False,
                                                     "properties": {"name": {"type": "string"},
                                                                    "mountPath": {"type": "string", "pattern": "^/"},
                                                                    "readOnly": {"type": "boolean"}}}},
    },
}  # fmt: skip
VOLUME = {
    "type": "object", "required": ["name"], "additionalProperties": False, "minProperties": 2, "maxProperties": 2,
    "properties": {"name": {"type": "string", "pattern": DNS1123_LABEL},
                   "emptyDir": {"type": "object", "properties": {"medium": {"enum": ["", "Memory"]}},
                                "additionalProperties": False},
                   "hostPath": {"type": "object", "required": ["path"], "additionalProperties": False,
                                "properties": {"path": {"type": "string", "pattern": "^/"},
                                               "type": {"enum": ["Directory", "DirectoryOrCreate", "File"]}}},
                   "configMap": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
}  # fmt: skip
DEPLOYMENT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "apps/v1"}, "kind": {"const": "Deployment"}, "metadata": META,
        "spec": {"type": "object", "required": ["selector", "template"], "additionalProperties": False, "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "strategy": {"type": "object", "properties": {"type": {"enum": ["Recreate", "RollingUpdate"]}}},
            "selector": {"type": "object", "required": ["matchLabels"],
                         "properties": {"matchLabels": {**LABELS, "minProperties": 1}}},
            "template": {"type": "object", "required": ["metadata", "spec"], "properties": {
                "metadata": {"type": "object", "required": ["labels"], "properties": {"labels": LABELS}},
                "spec": {"type": "object", "required": ["containers"], "additionalProperties": False, "properties": {
                    "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
                    "volumes": {"type": "array", "items": VOLUME},
                    "resourceClaims": {"type": "array", "items": CLAIM_REF},
                    "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0}}}}}}},
    },
}  # fmt: skip
SERVICE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "Service"},
        "metadata": {**META, "properties": {**META["properties"],
                                            "name": {"type": "string", "pattern": DNS1035_LABEL}}},
        "spec": {"type": "object", "required": ["selector", "ports"], "additionalProperties": False, "properties": {
            "selector": {**LABELS, "minProperties": 1},
            "ports": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["port", "targetPort"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "port": PORT,
                               "targetPort": {"anyOf": [PORT, {"type": "string"}]},
                               "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}}}},
    },
}  # fmt: skip
CONFIGMAP = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "data"], "additionalProperties": False,
    "properties": {"apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "metadata": META,
                   "data": {"type": "object", "additionalProperties": {"type": "string"},
                            "propertyNames": {"pattern": r"^[-._a-zA-Z0-9]+$"}}},
}  # fmt: skip
_DEVICE_REQUEST = {"type": "object", "required": ["name", "exactly"],
                   "properties": {"name": {"type": "string"},
                                  "exactly": {"type": "object", "required": ["deviceClassName"]}}}  # fmt: skip
_CLAIM_SPEC = {"type": "object", "required": ["devices"], "properties": {"devices": {
    "type": "object", "required": ["requests"],
    "properties": {"requests": {"type": "array", "minItems": 1, "items": _DEVICE_REQUEST}}}}}  # fmt: skip
CLAIM_TEMPLATE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {"apiVersion": {"const": "resource.k8s.io/v1"}, "kind": {"const": "ResourceClaimTemplate"},
                   "metadata": META,
                   "spec": {"type": "object", "required": ["spec"], "properties": {"spec": _CLAIM_SPEC}}},
}  # fmt: skip
SCHEMAS = {"Deployment": DEPLOYMENT, "Service": SERVICE, "ConfigMap": CONFIGMAP,
           "ResourceClaimTemplate": CLAIM_TEMPLATE}  # fmt: skip

# Upstream's POST /workers body (WorkerConfigRequest): url required, the rest optional, typed.
WORKER_BODY = {
    "type": "object", "required": ["url"], "additionalProperties": False,
    "properties": {"url": {"type": "string", "pattern": r"^https?://[^\s/]+(:\d+)?/?$"},
                   "model_id": {"type": "string", "minLength": 1}, "api_key": {"type": "string"},
                   "priority": {"type": "integer", "minimum": 0}, "cost": {"type": "number"},
                   "worker_type": {"enum": ["regular", "prefill", "decode"]},
                   "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
}  # fmt: skip


# ------------------------------------------------------------------ fixtures


def _config(tmp_path, cuda_models=1):
    for n in ("a", "org/B.v2", "c", "d"):
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    models = [{"name": "a", "path": "a", "device": "cpu0", "priority": 3},
              {"name": "org/B.v2", "path": "org/B.v2", "device": "cpu0", "max_inflight": 2},
              {"name": "c", "path": "c", "device": "gpu0"}]  # fmt: skip
    if cuda_models == 2:
        models.append({"name": "d", "path": "d", "device": "gpu0"})
    cfg = parse_config({
        "models": models,
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": 0.5, "cores": [0, 1, 2]},
                    {"name": "gpu0", "kind": "cuda", "memory_gb": 2}],
        "router": {"port": 30100, "max_queued": 16, "max_inflight_per_engine": 8},
    }, base_dir=tmp_path)  # fmt: skip
    return cfg, plan_placement(cfg)


def _flag(argv, flag):
    return argv[argv.index(flag) + 1]


def test_gateway_without_caps_leaves_its_limits_to_the_gateway(tmp_path):
    cfg, _ = _config(tmp_path)
    uncapped = replace(cfg, router=replace(cfg.router, max_queued=None, max_inflight_per_engine=None))
    argv = emit.gateway_command(uncapped)  # org/B.v2's cap of 2 cannot bound a global limit: a and c have none
    assert "--queue-size" not in argv and "--max-concurrent-requests" not in argv
    models = tuple(replace(m, max_inflight=3) for m in uncapped.models)
    argv = emit.gateway_command(replace(uncapped, models=models))
    assert "--queue-size" not in argv and _flag(argv, "--max-concurrent-requests") == "9"


def _docs(cfg, placement, opts=None):
    text = emit.k8s_files(cfg, placement, opts or emit.EmitOptions())["sglang-memx.yaml"]
    docs = list(yaml.safe_load_all(text))
    assert "&id" not in text and "*id" not in text  # plain YAML, no anchors
    return docs


def _engine_pods(docs):
    return [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["labels"].get(
        "app.kubernetes.io/component") == "engine"]  # fmt: skip


def _model_of(container):
    argv = container.get("command", []) + container.get("args", [])
    return _flag(argv, "--served-model-name")


# ------------------------------------------------------------------ Kubernetes


@pytest.mark.parametrize("cuda_models", [1, 2])
def test_manifests_parse_and_match_the_schemas(tmp_path, cuda_models):
    cfg, p = _config(tmp_path, cuda_models)
    docs = _docs(cfg, p)
    assert {d["kind"] for d in docs} <= set(SCHEMAS)
    for d in docs:
        jsonschema.validate(d, SCHEMAS[d["kind"]])
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        spec = dep["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        pod = spec["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        claims = {c["name"] for c in pod.get("resourceClaims", [])}
        cnames = [c["name"] for c in pod["containers"]]
        ports = [pt["containerPort"] for c in pod["containers"] for pt in c.get("ports", [])]
        assert len(cnames) == len(set(cnames)) and len(ports) == len(set(ports))  # one network namespace
        for c in pod["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
            assert {x["name"] for x in c.get("resources", {}).get("claims", [])} <= claims
            for probe in ("startupProbe", "readinessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in [pt["containerPort"] for pt in c["ports"]]


@pytest.mark.parametrize("cuda_models", [1, 2])
def test_every_model_once_colocated_models_share_one_pod_and_its_pool(tmp_path, cuda_models):
    cfg, p = _config(tmp_path, cuda_models)
    docs = _docs(cfg, p)
    seen = []
    for dep in _engine_pods(docs):
        device = dep["metadata"]["annotations"]["sglang-memx/device"]
        pod = dep["spec"]["template"]["spec"]
        models = [_model_of(c) for c in pod["containers"]]
        seen += models
        assert sorted(models) == sorted(p.devices[device].models)  # the placement's co-location, one Pod
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
        pool_volume = [v for v in pod["volumes"] if v["name"] == "memx-pool"]
        assert pool_volume == [{"name": "memx-pool", "emptyDir": {}}]
        pools = set()
        for c in pod["containers"]:
            argv = c["command"] + c["args"]
            mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert _flag(argv, "--memx-pool-dir") == mount["memx-pool"] + "/pools"  # memx makes it 0700
            assert "--memx-elastic-kv" in argv and _flag(argv, "--host") == "0.0.0.0"
            pools.add((_flag(argv, "--memx-pool"), _flag(argv, "--memx-pool-budget-gb")))
            model = cfg.model(_model_of(c))
            assert mount[[m["name"] for m in c["volumeMounts"] if m["mountPath"] == model.path][0]] == model.path
        assert len(pools) == 1  # one pool name and budget per device
    assert sorted(seen) == sorted(m.name for m in cfg.models)  # every placed model exactly once


def test_containers_run_the_launchers_command_line(tmp_path):
    cfg, p = _config(tmp_path)
    units = emit.model_units(cfg, p, emit.EmitOptions())
    specs = engine_specs(cfg, p, run_id="k8s", ports={u.model: u.port for u in units}, python="python3")
    by_model = {
        _model_of(c): c for d in _engine_pods(_docs(cfg, p)) for c in d["spec"]["template"]["spec"]["containers"]
    }
    for s in specs:
        c = by_model[s.model]
        argv = c["command"] + c["args"]
        argv = argv[argv.index("python3") :]
        expected = list(s.argv)
        expected[expected.index("--host") + 1] = "0.0.0.0"
        expected[expected.index("--memx-pool-dir") + 1] = emit.POOL_DIR
        assert argv == expected
        env = {e["name"]: e["value"] for e in c["env"]}
        assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin / DRA picks the GPU


@pytest.mark.parametrize("cuda_models", [1, 2])
def test_resources_by_device_kind(tmp_path, cuda_models):
    cfg, p = _config(tmp_path, cuda_models)
    docs = _docs(cfg, p)
    by_model = {}
    for d in _engine_pods(docs):
        for c in d["spec"]["template"]["spec"]["containers"]:
            by_model[_model_of(c)] = (d, c)
    # cpu: the launcher's split of the device's cores (3 cores, 2 models: 2 + 1), memory request <= limit
    cpus = sorted(int(by_model[n][1]["resources"]["requests"]["cpu"]) for n in ("a", "org/B.v2"))
    assert cpus == [1, 2]
    for n in ("a", "org/B.v2"):
        c = by_model[n][1]
        r = c["resources"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["OMP_NUM_THREADS"] == r["requests"]["cpu"] and env["SGLANG_USE_CPU_ENGINE"] == "1"
        req, lim = (int(r[k]["memory"].removesuffix("Mi")) for k in ("requests", "limits"))
        assert 0 < req <= lim and "nvidia.com/gpu" not in r.get("limits", {})
        assert c["image"] == "sglang-memx:cpu" and c["args"][:3] == ["python3", "-m", "sglang.launch_server"]
    gpu_dep, c = by_model["c"]
    assert c["image"] == "sglang-memx:gpu" and c["command"] == ["python3", "-m", "sglang.launch_server"]
    templates = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    if cuda_models == 1:
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}} and not templates
    else:  # two containers, one GPU: a DRA claim both reference (the device plugin gives a GPU to one container)
        (t,) = templates
        pod = gpu_dep["spec"]["template"]["spec"]
        assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": t["metadata"]["name"]}]
        assert all(x["resources"] == {"claims": [{"name": "gpu"}]} for x in pod["containers"])
        assert t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.nvidia.com"


def test_services_select_the_pod_and_target_the_models_port(tmp_path):
    cfg, p = _config(tmp_path, 2)
    docs = _docs(cfg, p)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    services = [d for d in docs if d["kind"] == "Service"]
    models = []
    for s in services:
        sel = s["spec"]["selector"]
        (dep,) = [d for d in deployments if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        pod_ports = {
            pt["containerPort"]: c for c in dep["spec"]["template"]["spec"]["containers"] for pt in c.get("ports", [])
        }
        (port,) = s["spec"]["ports"]
        assert port["targetPort"] in pod_ports
        model = s["metadata"].get("annotations", {}).get("sglang-memx/model")
        if model is not None:
            models.append(model)
            assert _model_of(pod_ports[port["targetPort"]]) == model
            assert port["port"] == 30000
        else:
            assert s["metadata"]["name"] == "memx-gateway" and port["port"] == port["targetPort"] == 30100
    assert sorted(models) == sorted(m.name for m in cfg.models)


def test_gateway_lists_every_model_with_its_service_url(tmp_path):
    cfg, p = _config(tmp_path, 2)
    opts = emit.EmitOptions(namespace="llm")
    docs = _docs(cfg, p, opts)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    workers = json.loads(cm["data"]["workers.json"])
    assert workers == emit.worker_registrations(cfg, p, opts)
    assert cm["data"]["register_workers.py"] == emit.REGISTER_WORKERS_PY  # survives the YAML | block
    assert sorted(w["model_id"] for w in workers) == sorted(m.name for m in cfg.models)
    for w in workers:
        jsonschema.validate(w, WORKER_BODY)
        host, port = w["url"].removeprefix("http://").split(":")
        svc, ns, rest = host.split(".", 2)
        assert (ns, rest, int(port)) == ("llm", "svc", 30000)
        assert services[svc]["metadata"]["annotations"]["sglang-memx/model"] == w["model_id"]
    (gw,) = [d for d in docs if d["metadata"]["name"] == "memx-gateway" and d["kind"] == "Deployment"]
    gateway, register = gw["spec"]["template"]["spec"]["containers"]
    argv = gateway["command"] + gateway["args"]
    assert argv[:4] == ["python3", "-m", "sglang_router.launch_router", "--enable-igw"]
    assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--port") == "30100"
    assert "--worker-urls" not in argv  # multi-model mode registers workers instead
    assert _flag(argv, "--max-concurrent-requests") == str(8 + 2 + 8 + 8) and _flag(argv, "--queue-size") == "16"
    assert register["command"][:2] == ["python3", "/etc/memx-gateway/register_workers.py"]
    assert _flag(register["command"], "--gateway") == "http://127.0.0.1:30100"


def test_gateway_files(tmp_path):
    cfg, p = _config(tmp_path)
    files = emit.gateway_files(cfg, p, emit.EmitOptions(worker_url_template="http://10.0.0.7:{engine_port}"))
    assert set(files) == {"gateway.sh", "workers.json", "register_workers.py"}
    workers = json.loads(files["workers.json"])
    units = {u.model: u for u in emit.model_units(cfg, p, emit.EmitOptions())}
    assert {w["model_id"]: w["url"] for w in workers} == {n: f"http://10.0.0.7:{u.port}" for n, u in units.items()}
    (line,) = [ln for ln in files["gateway.sh"].splitlines() if "sglang_router.launch_router" in ln]
    argv = shlex.split(line.removesuffix(" &"))
    assert argv == emit.gateway_command(cfg)
    assert _flag(argv, "--host") == "127.0.0.1"  # router.host of the config
    r = subprocess.run(["bash", "-n", "-c", files["gateway.sh"]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    compile(files["register_workers.py"], "register_workers.py", "exec")


def test_gateway_command_parses_with_upstreams_own_parser(tmp_path):
    """Only where sglang-router is installed (it is not in the project's lock)."""
    launch_router = pytest.importorskip("sglang_router.launch_router")
    cfg, _ = _config(tmp_path)
    args = launch_router.parse_router_args(emit.gateway_command(cfg)[3:])
    assert args.enable_igw and args.port == 30100 and args.worker_urls == [] and args.queue_size == 16


def test_api_key_is_referenced_never_written(tmp_path):
    for n in ("a", "b"):
        fake_model(tmp_path, n)
    key = "s3cret-KEY-42"
    cfg = parse_config({"models": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
                        "devices": [{"name": "cpu0", "memory_gb": 1, "cores": [0, 1]}],
                        "router": {"api_key": key}}, base_dir=tmp_path)  # fmt: skip
    p = plan_placement(cfg)
    text = emit.k8s_files(cfg, p, emit.EmitOptions())["sglang-memx.yaml"]
    files = emit.gateway_files(cfg, p, emit.EmitOptions())
    assert key not in text and not any(key in t for t in files.values())
    docs = list(yaml.safe_load_all(text))
    secret = {"secretKeyRef": {"name": "memx-api-key", "key": "api-key"}}
    containers = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    for c in containers:
        jsonschema.validate(c, CONTAINER)
        assert {"name": "MEMX_API_KEY", "valueFrom": secret} in c["env"]
        argv = c["command"] + c.get("args", [])
        if "register_workers.py" not in argv[1]:
            assert _flag(argv, "--api-key") == "$(MEMX_API_KEY)"  # expanded by the kubelet from env
    assert '"$MEMX_API_KEY"' in files["gateway.sh"] and ': "${MEMX_API_KEY:?' in files["gateway.sh"]
    r = subprocess.run(["bash", "-n", "-c", files["gateway.sh"]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bad_options_name_the_field(tmp_path):
    cfg, p = _config(tmp_path)
    url = "--worker-url-template"
    for opts, field in [(emit.EmitOptions(namespace="Bad_NS"), "--namespace"),
                        (emit.EmitOptions(image="a b"), "--image"),
                        (emit.EmitOptions(gateway_image=""), "--gateway-image"),
                        (emit.EmitOptions(worker_url_template="http://{nope}:1"), url),
                        (emit.EmitOptions(worker_url_template="http://{service"), url),
                        (emit.EmitOptions(worker_url_template="{service}:30000"), url)]:  # fmt: skip
        with pytest.raises(ServeConfigError) as e:
            emit.k8s_files(cfg, p, opts)
        assert e.value.field == field


def test_replicas_are_refused_by_field_not_emitted_as_one(tmp_path):
    fake_model(tmp_path, "a", weight_bytes=1 << 20)
    cfg = parse_config({"models": [{"name": "a", "path": "a", "min_replicas": 2}],
                        "devices": [{"name": "cpu0", "memory_gb": 0.5}]}, base_dir=tmp_path)  # fmt: skip
    p = plan_placement(cfg)
    for files in (emit.k8s_files, emit.gateway_files):
        with pytest.raises(ServeConfigError) as e:
            files(cfg, p, emit.EmitOptions())
        assert e.value.field == "models[0].min_replicas" and "not emitted yet" in str(e.value)


def test_names_are_distinct_dns_labels():
    names = ["A", "a", "org/Model.v1", "org/model-v1", "x" * 80, "x" * 80 + "y", "_"]
    slugs = emit._slugs(names, "memx-")
    assert len(set(slugs.values())) == len(names)
    for s in slugs.values():
        assert len(s) <= 63 and emit._DNS_LABEL.fullmatch(s), s


def test_cpu_wrapper_binds_the_containers_cores():
    if shutil.which("python3") is None:
        pytest.skip("no python3 on PATH")
    r = subprocess.run(["/bin/sh", "-c", emit._BIND_CORES, "bind-cores", "sh", "-c",
                        'echo "$SGLANG_CPU_OMP_THREADS_BIND"'], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(map(str, sorted(os.sched_getaffinity(0))))


# ------------------------------------------------------------------ the registrar


class _FakeGateway(http.server.BaseHTTPRequestHandler):
    workers: list = []
    posts: list = []

    def do_GET(self):
        body = json.dumps({"workers": self.workers, "total": len(self.workers)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posts.append(data)
        type(self).workers.append({"url": data["url"], "model_id": data.get("model_id")})
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def test_register_workers_posts_only_the_missing_ones(tmp_path):
    spec = importlib.util.spec_from_loader("register_workers", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(emit.REGISTER_WORKERS_PY, mod.__dict__)
    _FakeGateway.workers = [{"url": "http://memx-a.default.svc:30000", "model_id": "a"}]
    _FakeGateway.posts = []
    with serving(_FakeGateway) as gw:
        bodies = [{"url": "http://memx-a.default.svc:30000", "model_id": "a"},
                  {"url": "http://memx-b.default.svc:30000", "model_id": "b"}]  # fmt: skip
        f = tmp_path / "workers.json"
        f.write_text(json.dumps(bodies))
        assert mod.main(["--gateway", gw, "--timeout", "10", str(f)]) == 0
        assert _FakeGateway.posts == [bodies[1]]
        assert mod.main(["--gateway", gw, str(f)]) == 0 and len(_FakeGateway.posts) == 1  # idempotent
    assert mod.main(["--gateway", gw, "--timeout", "0.1", str(f)]) == 1  # nothing answers: times out
    assert "Authorization" not in mod._headers() and mod.KEY is None


# ------------------------------------------------------------------ the command


def _serve(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sglang_memx.serve", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)  # fmt: skip


def test_cli_emit_writes_the_artefacts_and_starts_nothing(tmp_path):
    fake_model(tmp_path, "a")
    fake_model(tmp_path, "b")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: a}\n  - {name: b, path: b}\n"
                   "devices:\n  - {name: cpu0, memory_gb: 1, cores: [0, 1]}\n")  # fmt: skip
    r = _serve("--config", str(cfg), "--emit", "k8s", "--out", "k8s", "--namespace", "llm", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "k8s" / "sglang-memx.yaml").removeprefix(str(tmp_path) + "/")]
    assert "nothing started" in r.stderr
    docs = list(yaml.safe_load_all((tmp_path / "k8s" / "sglang-memx.yaml").read_text()))
    (dep,) = _engine_pods(docs)
    assert sorted(_model_of(c) for c in dep["spec"]["template"]["spec"]["containers"]) == ["a", "b"]
    assert all(d["metadata"]["namespace"] == "llm" for d in docs)
    r = _serve("--config", str(cfg), "--emit", "gateway", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "sglang-memx-gateway")) == ["gateway.sh", "register_workers.py",
                                                                     "workers.json"]  # fmt: skip
    assert not list(tmp_path.glob("sglang-memx-serve-logs"))  # no engine was started
    r = _serve("--config", str(cfg), "--emit", "k8s", "--namespace", "NO", "--out", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("sglang-memx serve: error: --namespace:")
    assert not (tmp_path / "x").exists()
    cfg.write_text("models:\n  - {name: a, path: nowhere}\ndevices:\n  - {name: cpu0, memory_gb: 1}\n")
    r = _serve("--config", str(cfg), "--emit", "k8s", "--out", "y", cwd=tmp_path)
    assert r.returncode == 2 and "models[0].path" in r.stderr and not (tmp_path / "y").exists()
