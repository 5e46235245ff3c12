"""Scheduler and hook kinds usable in scenario files: one literal table each.

``SCHEDULERS[kind](cfg, **options) -> Scheduler`` builds ``models[i].scheduler``
(``cfg``: the instance's ``core.engine.InstanceConfig``);
``HOOKS[kind](inst, **options) -> InstanceHook`` builds ``models[i].hooks[j]``
(called once the instance exists). To add a kind, write its class (a
scheduler: ``plan(inst, now) -> BatchPlan``; a hook: ``before_iteration`` /
``after_iteration``; a mechanism also ``stats()``, see ``core.stats``) and add
one row here. Nothing registers itself on import.

An unknown kind is reported by the scenario loader at the field that names it
(``models[i].scheduler.kind`` / ``models[i].hooks[j].kind``); ``make_scheduler``
and ``make_hook`` raise ``UnknownKind`` (a ``ValueError``) for specs built by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .core.batching import ContinuousBatchingScheduler, VllmV0Scheduler
from .core.engine import Instance, InstanceConfig
from .mechanisms.ellm import EllmElasticScheduler, EllmScheduler
from .mechanisms.fineserve import FineServeScheduler
from .mechanisms.governed_ellm import GovernedEllmScheduler
from .mechanisms.governor import GovernedScheduler
from .mechanisms.layer_streaming import LayerStreamingHook
from .mechanisms.oneiros import OneirosHook
from .mechanisms.select_n import FlexGenStaticHook, SelectNHook
from .mechanisms.swiftcache import SwiftCacheHook

__all__ = ["SCHEDULERS", "HOOKS", "X1_AVAILABLE", "UnknownKind", "make_scheduler", "make_hook"]

SCHEDULERS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "continuous": lambda cfg, **opts: ContinuousBatchingScheduler(**opts),  # stock baseline
        "vllm_v0": VllmV0Scheduler,  # vLLM v0 default: prefill-only iterations, recompute preemption
        "ellm": EllmScheduler,  # eLLM Alg. 1
        "ellm_elastic": EllmElasticScheduler,  # eLLM Alg. 1 + CPU buffer + Alg. 2
        "fineserve": FineServeScheduler,  # FineServe slab KV + EDF batching
        "governed": GovernedScheduler,  # stock continuous batching + the governor's TPOT batch decision
        "governed_ellm": GovernedEllmScheduler,  # governed + eLLM's admission passed through the governor
    }
)

HOOKS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "layer_streaming": LayerStreamingHook,  # generic weight streaming
        "oneiros": OneirosHook,  # Oneiros parameter remapping
        "select_n": SelectNHook,  # Select-N offloading intervals
        "flexgen_static": FlexGenStaticHook,  # Select-N's FlexGen-like baseline
        "swiftcache": SwiftCacheHook,  # SwiftCache peer / host prefix tiers
    }
)


# the kinds the X1 scenario (combined_x1.yaml) composes, and whether the tables have each
X1_AVAILABLE: Mapping[str, bool] = MappingProxyType(
    {kind: kind in HOOKS or kind in SCHEDULERS for kind in ("oneiros", "select_n", "swiftcache", "ellm_elastic")}
)


class UnknownKind(ValueError):
    """A scheduler or hook kind that is not in the tables."""


def _lookup(table: Mapping[str, Callable[..., Any]], what: str, kind: str) -> Callable[..., Any]:
    try:
        return table[kind]
    except KeyError:
        raise UnknownKind(f"unknown {what} kind {kind!r} (known: {', '.join(sorted(table))})") from None


def make_scheduler(kind: str, cfg: InstanceConfig, options: dict[str, Any]):
    return _lookup(SCHEDULERS, "scheduler", kind)(cfg, **options)


def make_hook(kind: str, inst: Instance, options: dict[str, Any]):
    return _lookup(HOOKS, "hook", kind)(inst, **options)
