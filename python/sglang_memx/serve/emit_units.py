"""The placed models as emit units (``serve --emit``): options, names, command lines.

``model_units`` turns the launcher's engine specs into one ``ModelUnit`` per model, made
cluster-ready (``python3``, ``--host 0.0.0.0``, a fixed port, the Pod's shared pool
directory). Invariant: every placed model is exactly one unit; a bad option raises
``ServeConfigError`` naming it.
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass

from ..compute_share import BOARD_ENV, SHARES_ENV, SLOT_ENV
from .config import ServeConfig, ServeConfigError
from .cores import split_cores
from .engine_specs import engine_specs
from .placement import GIB, Placement
from .tensor_parallel import tensor_parallel_size

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
        tp = tensor_parallel_size(f"models[{i}].server_args", m.server_args)
        if tp > 1:  # a Pod binds its engine's threads to its cpuset as one group, not one per rank
            raise ServeConfigError(f"models[{i}].server_args", f"--tp {tp}: --emit does not write tensor "
                                   "parallel engines yet (a Pod binds its cpuset as one group of cores)")  # fmt: skip
    ports = {m.name: opts.base_engine_port + i for i, m in enumerate(config.models)}
    keyed = {"api_key": API_KEY_REF} if config.router.api_key else {}
    specs = engine_specs(config, placement, run_id="k8s", ports=ports, python="python3", **keyed)
    services = _slugs([m.name for m in config.models], "memx-")
    containers = _slugs([m.name for m in config.models], "")
    cpus = {}
    for d in config.devices:
        residents = placement.devices[d.name].models
        if d.kind == "cpu" and residents:
            shares = split_cores(list(d.cores), len(residents)) if d.cores else [[0]] * len(residents)
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
