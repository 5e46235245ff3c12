"""Which served shapes (model class, KV pool class, parallel layout) memx's features support,
and the refusal that names the flag, the model class and the pool class (docs/models.md).

Every memx feature needs ``--memx-elastic-kv`` (``MemxConfig`` validation), and elastic KV backs one
plain ``MHATokenToKVPool`` per server, upstream's plain ``MLATokenToKVPool`` (``MLA_READY_FLAGS``), or
both ``MHATokenToKVPool`` sub-pools of a hybrid sliding-window model's ``SWAKVPool`` as two spaces on
one pool (``SWA_READY_FLAGS``). Refused before anything is built, from facts the caller gathers
through the adapter:

* a KV pool of another class (the hybrid linear-attention pool), and on the MLA and SWA pools the
  flags not written for them;
* pipeline parallel size above 1, and tensor parallel size above 1 with a feature whose inputs
  could differ between ranks (``TP_READY_FLAGS`` and ``TP_WEIGHTS_FLAGS`` list the ones that cannot):
  upstream's ranks must schedule the same batch, so every count memx lets upstream read must be equal
  on every rank. Each rank's pool reads the same allocator, queue and budget; the rank-local inputs
  memx keeps are agreed across ranks (``coordinator.rank_agreement``: a measured activation peak,
  rank 0's clock for the governor and the host buffer's Alg. 2, rank 0's Oneiros decision), and the
  counts are checked every busy iteration. On a shared pool the ranks borrow in one step of the tick and
  agree on their FREE and the arbiter's reclaims (``coordinator.rank_pools``), and a weights restore short of
  FREE borrows in that step (``weights.remap``); sleep and the peer tier are refused.

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
MLA_POOL = "MLATokenToKVPool"
HYBRID_SWA_POOL = "SWAKVPool"
# What runs at tensor parallel size > 1: elastic KV on each rank's pool (KV and activations ballooning), own
# or shared (every rank a client of the arbiter, ``coordinator.rank_pools``)
TP_READY_FLAGS = ("--memx-elastic-kv", "--memx-pool-budget-gb", "--memx-chunk-kb", "--memx-status-path",
                  "--memx-torch-activations", "--memx-tpot-slo-ms", "--memx-governor", "--memx-tpot-slo-scale",
                  "--memx-host-buffer-gb", "--memx-ttft-slo-ms", "--memx-pool", "--memx-pool-dir")  # fmt: skip
# Remappable weights (static, and remap with every rank applying rank 0's decision), own or shared pool. Sleep
# (rank 0's answer on every rank, weights/sleep.py) stays refused: by hand a burst after a wake crashed both
# ranks in upstream's prepare_for_extend ("Out of memory", 2 tokens short), cause not found
TP_WEIGHTS_FLAGS = ("--memx-weights", "--memx-weights-streamed", "--memx-prefetch-depth", "--memx-tbt-slo-ms",
                    "--memx-weights-profile", "--memx-weights-idle-after-s")  # fmt: skip
# What runs on the MLA pool (one latent row per token and layer, ``upstream.kv.plain_mla_refusal``): elastic KV,
# own or shared, the host buffer and the governor, which see rows and pages whatever the row holds. Remappable
# weights (layer discovery is written for the Llama-like and Gemma2 decoders), the peer tier and the layer stream
# cache (they move K and V rows of an MHA pool) are refused
MLA_READY_FLAGS = TP_READY_FLAGS
# What runs on a hybrid sliding-window model's SWAKVPool: elastic KV on both sub-pools, two spaces on the server's
# own pool (``coordinator.swa_spaces``). Activations stay outside the pool (as in stock); the shared pool, the host
# buffer, the governor, remappable weights and the peer tier are not written for two spaces yet
SWA_READY_FLAGS = ("--memx-elastic-kv", "--memx-pool-budget-gb", "--memx-chunk-kb", "--memx-status-path")
# Measured 2026-12-07 with stock upstream alone (docs/models.md, "Mellum"): torch_native's extend and decode read a
# sliding-window layer's KV at the full-attention pool's slots, right only while both sub-allocators hand out the
# same slots; under memory pressure stock fails with an IndexError, and rows elastic KV has not mapped would fault
SWA_CPU_WHY = (
    "upstream's CPU attention (torch_native) reads the sliding-window sub-pool at full-pool slots "
    "(stock itself fails under memory pressure: IndexError in _run_sdpa_forward_decode), so elastic KV "
    "backs SWAKVPool on a GPU only"
)
UNKNOWN_MODEL = "this model"


@dataclass(frozen=True)
class ServedShape:
    """What upstream will serve: the model class (``architectures[0]``), the KV pool class it
    builds (None: not known yet) and the tensor / pipeline parallel sizes."""

    model_class: str
    pool_class: str | None
    tp_size: int = 1
    pp_size: int = 1
    device: str = "cuda"  # the device kind (``upstream.server_args.device_kind``)


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


def tp_unready_flags(config: MemxConfig) -> list[str]:
    """The requested flags memx does not run at tensor parallel size > 1: all but ``TP_READY_FLAGS``
    and ``TP_WEIGHTS_FLAGS``."""
    return [f for f in config.requested_flags() if f not in TP_READY_FLAGS + TP_WEIGHTS_FLAGS]


def _dependent_flags(config: MemxConfig) -> str:
    others = [f for f in config.requested_flags() if f != FLAG]
    return f" (and with it {', '.join(others)})" if others else ""


def check_served_shape(config: MemxConfig, shape: ServedShape) -> None:
    """Raise ``MemxConfigError`` naming ``--memx-elastic-kv``, the model class and the pool class
    when memx is asked for a shape it cannot serve; nothing when memx's KV features are off."""
    if config.disabled or not config.elastic_kv:
        return
    pool = shape.pool_class or "KV pool"
    if shape.pp_size > 1:
        raise MemxConfigError(
            FLAG,
            f"{shape.model_class} at pipeline parallel size {shape.pp_size} builds one {pool} per stage "
            f"({shape.tp_size * shape.pp_size} scheduler processes, each deciding alone); elastic KV"
            f"{_dependent_flags(config)} needs --pp 1 for now; run with --pp 1 or without the memx flags",
        )
    not_ready = tp_unready_flags(config)
    if shape.tp_size > 1 and not_ready:
        verb = "decides" if len(not_ready) == 1 else "decide"
        raise MemxConfigError(
            not_ready[0],
            f"{shape.model_class} at tensor parallel size {shape.tp_size} builds one {pool} per rank and every "
            f"rank must schedule the same batch; {', '.join(not_ready)} {verb} from what one rank measures or is "
            f"given (a peer's reach, a sleeping model's wake-up), which the ranks do "
            f"not share yet; at --tp {shape.tp_size} memx runs elastic KV on each rank's pool, own or shared "
            f"({', '.join(TP_READY_FLAGS[:3])}, --memx-pool), the host buffer, the governor and remappable "
            f"weights; "
            f"run with --tp 1 or without "
            f"{', '.join(not_ready)}",
        )
    if shape.pool_class == MLA_POOL:
        _check_pool_flags(config, shape.model_class, MLA_POOL)
        return
    if shape.pool_class == HYBRID_SWA_POOL:
        if shape.device == "cpu":
            raise MemxConfigError(FLAG, f"{shape.model_class} is served from upstream's {HYBRID_SWA_POOL}, and on the "
                                        f"CPU {SWA_CPU_WHY}; run with --disable-hybrid-swa-memory (one full-length "
                                        "MHATokenToKVPool, every memx feature) or without the flag")  # fmt: skip
        _check_pool_flags(config, shape.model_class, HYBRID_SWA_POOL)
        return
    if shape.pool_class is not None and shape.pool_class != ELASTIC_POOL:
        raise MemxConfigError(
            FLAG,
            f"{shape.model_class} is served from upstream's {shape.pool_class}, which elastic KV does not back; "
            f"elastic KV{_dependent_flags(config)} backs upstream's {ELASTIC_POOL} and {MLA_POOL} (unquantized, "
            f"NHD layout) and, on a GPU, both sub-pools of its {HYBRID_SWA_POOL}; run without the flag",
        )


# per pool elastic KV backs beside the MHA pool: (flags that run on it, the pool in words, what memx does on it,
# why the other flags do not run)
_POOL_FLAGS = {
    MLA_POOL: (MLA_READY_FLAGS, "one compressed latent per token and layer",
               "memx backs it with elastic KV, own or shared, the host buffer and the governor",
               "not written for it (remappable weights find the layers of Llama-like and Gemma2 decoders only; the "
               "peer tier and the layer stream cache move an MHA pool's K and V rows)"),
    HYBRID_SWA_POOL: (SWA_READY_FLAGS, "a full-attention and a sliding-window sub-pool of different sizes",
                      f"memx backs both with elastic KV on the server's own pool ({', '.join(SWA_READY_FLAGS)})",
                      "not written for two KV spaces yet"),
}  # fmt: skip


def _check_pool_flags(config: MemxConfig, model_class: str, pool: str) -> None:
    """The MLA pool or SWAKVPool: elastic KV and what runs on it (``_POOL_FLAGS``); any other flag
    refused by name."""
    ready, what, does, why = _POOL_FLAGS[pool]
    not_ready = [f for f in config.requested_flags() if f not in ready]
    if not not_ready:
        return
    verb = "is" if len(not_ready) == 1 else "are"
    raise MemxConfigError(
        not_ready[0],
        f"{model_class} is served from upstream's {pool} ({what}); {does}; {', '.join(not_ready)} {verb} {why}; "
        f"run without {', '.join(not_ready)}",
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
