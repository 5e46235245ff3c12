"""The parsed form of a scenario: what ``scenario.load_scenario`` produces and
``runner.build_simulation`` consumes (plain frozen dataclasses; the loader in
``benchmark/sim/scenario.py`` does all the checking)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .workload import WorkloadSpec

__all__ = ["NodeSpec", "ModelEntry", "ArbiterSpec", "ScenarioSpec"]


@dataclass(frozen=True)
class NodeSpec:
    gpu: str
    count: int = 1
    sharing: str = "time_slice"
    memory_fraction: float = 0.9
    compute_eff: float | None = None
    memory_eff: float | None = None


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model: str
    gpu: int = 0
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    block_size: int = 16
    max_batched_tokens: int = 2048
    max_running: int = 256
    prefix_caching: bool = True
    overhead_s: float = 5e-4
    share: float = 1.0
    kv_memory_gb: float | None = None
    activation_tokens: int | None = None
    ttft_slo_s: float = float("inf")
    tpot_slo_s: float = float("inf")
    scheduler: str = "continuous"
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    hooks: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class ArbiterSpec:
    """Scenario key ``arbiter`` (``benchmark/sim/mechanisms/arbiter.py``): every
    memory mechanism's capacity change goes through one node-wide
    ``memory_ext.policy.arbiter.MemoryArbiter``. ``share_kv``: idle KV of
    models with no work may be lent to co-located models (tier IDLE_PEER);
    ``floor_fraction``: share of its KV an idle model keeps;
    ``low_watermark_frac`` / ``high_watermark_frac``: an instance asks for
    memory when its free KV falls below low x its planned KV, up to high."""

    share_kv: bool = True
    floor_fraction: float = 0.25
    low_watermark_frac: float = 0.03
    high_watermark_frac: float = 0.15


@dataclass(frozen=True)
class ScenarioSpec:
    """One runnable configuration (the base file or one variant of it)."""

    name: str
    node: NodeSpec
    models: tuple[ModelEntry, ...]
    workloads: tuple[WorkloadSpec, ...]
    duration_s: float
    seed: int = 0
    drain_s: float = 600.0
    sample_period_s: float = 1.0
    description: str = ""
    source: str = "<memory>"
    arbiter: ArbiterSpec | None = None
