"""The ``models.yaml`` that ``scripts/serve.sh`` hands to ``sglang-memx serve``.

Two co-located models of different KV cell sizes on one CPU device and one shared memx
pool: the embedded SmolLM2-135M-Instruct in bfloat16 (23,040 B of KV per token) and its
float32 copy (``embedded_fp32``, 46,080 B per token). ``serve`` gives both engines elastic
KV and the device's pool; ``memx_args`` (by default the host buffer) go to both too.

Invariants:

* The written file passes ``sglang_memx.serve``'s own validation and placement
  (``parse_config`` + ``plan_placement``) before it is written; a bad option raises
  ``ServeConfigError`` naming the field, and nothing is written.
* The default budget fits a 2-core, 24 GiB box with room to spare: 2 GiB for the device
  (0.75 GiB of weights outside the pool, 1.25 GiB of pool for both models' KV and
  activations, mapped only as used) and 16,384 logical KV tokens per model.
* The file is replaced atomically (a reader sees the old or the new one, never half).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .embedded import EMBEDDED_MODEL_NAME, memx_home
from .embedded_fp32 import FP32_MODEL_NAME

__all__ = ["ServeOptions", "serve_config_doc", "default_config_path", "write_serve_config", "MODEL_NAMES"]

MODEL_NAMES = (EMBEDDED_MODEL_NAME, FP32_MODEL_NAME)
# On by the launcher for every engine; repeating it in memx_args is harmless and dropped.
_ALWAYS_ON = ("--memx-elastic-kv",)


@dataclass(frozen=True)
class ServeOptions:
    """What ``scripts/serve.sh`` lets a user change (``MEMX_*`` variables, extra arguments)."""

    host: str = "127.0.0.1"
    port: int = 30000
    memory_gb: float = 2.0  # the device's memory for both models: weights + the shared pool
    max_total_tokens: int = 16384  # logical KV tokens per model (reserved address space)
    memx_args: tuple[str, ...] = ("--memx-host-buffer-gb", "1")  # for every engine, besides elastic KV + pool
    server_args: tuple[str, ...] = ()  # launch_server flags for every engine
    log_dir: str | None = None  # None: <memx home>/serve/logs-<port>
    ttft_slo_ms: float = 2000.0


def default_config_path(port: int) -> Path:
    """``<memx home>/serve/models-<port>.yaml``: one file per port, so two scripts never share one."""
    return memx_home() / "serve" / f"models-{port}.yaml"


def serve_config_doc(bf16_dir: str | os.PathLike, fp32_dir: str | os.PathLike, opts: ServeOptions) -> dict:
    """The config document (plain dicts and lists; JSON is YAML)."""
    log_dir = opts.log_dir or str(memx_home() / "serve" / f"logs-{opts.port}")
    common = {
        "ttft_slo_ms": opts.ttft_slo_ms,
        "max_total_tokens": opts.max_total_tokens,
    }
    return {
        "models": [
            {
                "name": EMBEDDED_MODEL_NAME,
                "path": str(bf16_dir),
                "dtype": "bfloat16",
                **common,
                "server_args": list(opts.server_args),
            },
            # float32 must be explicit: SGLang's --dtype auto serves a float32 checkpoint in float16.
            {
                "name": FP32_MODEL_NAME,
                "path": str(fp32_dir),
                "dtype": "float32",
                **common,
                "server_args": list(opts.server_args),
            },
        ],
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": opts.memory_gb}],
        "router": {"host": opts.host, "port": opts.port},
        "launch": {"log_dir": log_dir, "memx_args": [a for a in opts.memx_args if a not in _ALWAYS_ON]},
    }


def write_serve_config(path: str | os.PathLike, bf16_dir, fp32_dir, opts: ServeOptions) -> Path:
    """Validate and place the document as ``serve`` will, then write it to ``path``."""
    import yaml

    from sglang_memx.serve.config import LAUNCHER_FLAGS, ServeConfigError, parse_config
    from sglang_memx.serve.placement import plan_placement

    doc = serve_config_doc(bf16_dir, fp32_dir, opts)
    for i, arg in enumerate(doc["launch"]["memx_args"]):
        if arg.split("=", 1)[0] in LAUNCHER_FLAGS:
            raise ServeConfigError(f"launch.memx_args[{i}]", f"{arg.split('=', 1)[0]} is set by the launcher")
    path = Path(path)
    plan_placement(parse_config(doc, base_dir=path.parent, source=str(path)))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        "# Written by `sglang-memx models serve-config` for scripts/serve.sh (rewritten on every run).\n"
        "# Two co-located models of different KV cell sizes, one CPU device, one shared memx pool:\n"
        "# docs/router.md for the schema.\n"
    ) + yaml.safe_dump(doc, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
