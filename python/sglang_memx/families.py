"""Which served shapes (model class, KV pool class, parallel layout) memx's features support,
and the refusal that names the flag, the model class and the pool class (docs/models.md).

Every memx feature needs ``--memx-elastic-kv`` (``MemxConfig`` validation), and elastic KV backs one
plain ``MHATokenToKVPool`` per server. Two served shapes are therefore refused before anything is
built, from facts the caller gathers through the adapter:

* a KV pool of another class, today a hybrid sliding-window model's ``SWAKVPool`` (a full-attention
  and a sliding-window sub-pool, each an ``MHATokenToKVPool`` of its own size), which elastic KV
  would otherwise back half (its first sub-pool only);
* tensor or pipeline parallel size above 1: one pool per rank, each rank's scheduler deciding alone.

Checked twice: in the launcher while the command line is validated (``ServedShape`` from the
checkpoint's ``config.json`` and upstream's hybrid-SWA rule; exit status 2), and in every scheduler
when upstream's KV configurator opens the pool build (its own resolved facts). Nothing here imports
sglang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_memx.config import MemxConfig, MemxConfigError

FLAG = "--memx-elastic-kv"
ELASTIC_POOL = "MHATokenToKVPool"
HYBRID_SWA_POOL = "SWAKVPool"
UNKNOWN_MODEL = "this model"
_POOL_WHY = {
    HYBRID_SWA_POOL: " (a full-attention and a sliding-window sub-pool of different sizes; backing one of them "
    "would leave the other static)",
}


@dataclass(frozen=True)
class ServedShape:
    """What upstream will serve: the model class (``architectures[0]``), the KV pool class it
    builds (None: not known yet) and the tensor / pipeline parallel sizes."""

    model_class: str
    pool_class: str | None
    tp_size: int = 1
    pp_size: int = 1


def pool_class_for(*, hybrid_swa: bool, mla: bool = False, linear: bool = False) -> str:
    """The KV pool class upstream builds for a model with these traits (the common cases of its
    configurator's choice; the refusal messages name it)."""
    if hybrid_swa:
        return HYBRID_SWA_POOL
    if mla:
        return "MLATokenToKVPool"
    if linear:
        return "HybridLinearKVPool"
    return ELASTIC_POOL


def _dependent_flags(config: MemxConfig) -> str:
    others = [f for f in config.requested_flags() if f != FLAG]
    return f" (and with it {', '.join(others)})" if others else ""


def check_served_shape(config: MemxConfig, shape: ServedShape) -> None:
    """Raise ``MemxConfigError`` naming ``--memx-elastic-kv``, the model class and the pool class
    when memx is asked for a shape it cannot serve; nothing when memx's KV features are off."""
    if config.disabled or not config.elastic_kv:
        return
    pool = shape.pool_class or "KV pool"
    ranks = shape.tp_size * shape.pp_size
    if ranks > 1:
        raise MemxConfigError(
            FLAG,
            f"{shape.model_class} at tensor parallel size {shape.tp_size} and pipeline parallel size "
            f"{shape.pp_size} builds one {pool} per rank ({ranks} scheduler processes, each deciding alone); "
            f"memx runs one pool per server, so elastic KV{_dependent_flags(config)} needs --tp 1 and --pp 1 "
            f"for now; run with --tp 1 --pp 1 or without the memx flags",
        )
    if shape.pool_class is not None and shape.pool_class != ELASTIC_POOL:
        raise MemxConfigError(
            FLAG,
            f"{shape.model_class} is served from upstream's {shape.pool_class}{_POOL_WHY.get(shape.pool_class, '')}; "
            f"elastic KV{_dependent_flags(config)} backs a single {ELASTIC_POOL} only (unquantized, NHD layout); "
            f"run without the flag",
        )


def checkpoint_config(model_path: str) -> dict | None:
    """The Hugging Face ``config.json`` of a local checkpoint directory, or None (a hub id, no file,
    or not JSON: the scheduler's check at the pool build still applies)."""
    path = Path(model_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def text_config(hf_config: dict) -> dict:
    """The text model's part of a Hugging Face config (``text_config`` of a multimodal one)."""
    inner = hf_config.get("text_config")
    return inner if isinstance(inner, dict) else hf_config


def architecture(hf_config: dict | None) -> str:
    archs = (hf_config or {}).get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else UNKNOWN_MODEL
