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

By job: ``emit_units`` (options, one unit per model), ``emit_gateway`` (the gateway's command,
``workers.json``, the registrar), ``emit_k8s`` (the manifests); this module writes the files.
"""

from __future__ import annotations

from pathlib import Path

from .config import ServeConfig, ServeConfigError
from .emit_gateway import REGISTER_WORKERS_PY, gateway_command, gateway_files, worker_registrations
from .emit_k8s import _BIND_CORES, k8s_files, k8s_manifests  # noqa: F401  (re-exported, as below)
from .emit_units import _DNS_LABEL, POOL_DIR, EmitOptions, ModelUnit, _slugs, model_units  # noqa: F401
from .placement import Placement

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
