"""X1: several memory mechanisms on one node, composed (scenario
``combined_x1``), and the registration point of the SwiftCache hook.

Importing this module registers ``swiftcache`` (``swiftcache_hook``) and
imports the other mechanism modules that exist (``oneiros_hook``,
``select_n_hook``, ``ellm_buffer``) so that their kinds are registered too.

Composition: with the scenario key ``arbiter`` (``node_arbiter.py``) one
node-wide ``memory_ext.policy.arbiter.MemoryArbiter`` owns every GPU's
memory budget and every capacity change of every mechanism goes through it,
in one documented priority order (idle memory first: free budget, borrowed
memory that sits idle, idle KV of models with no work; weights of idle
models are remapped only for what that leaves short; eLLM lends a model's
own idle activation, Select-N credits offloaded weights to its own KV,
SwiftCache lends a worker's idle KV as peer memory). It never takes blocks
in use, and it checks after every change that each GPU's accounts add up to
its budget. Link use is arbitrated by the fair-share links: weight streaming
(Oneiros / Select-N) and host-tier traffic share ``h2d``/``d2h``, peer KV
traffic uses NVLink. Without ``arbiter`` the mechanisms resize pools on
their own, as in the single-paper scenarios.

``mechanism_counters(sim)`` reports, per mechanism, a counter that is > 0
when that mechanism acted in a run (used by the test and the docs).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import swiftcache_hook  # noqa: F401  (registers "swiftcache")

AVAILABLE: dict[str, bool] = {}
for _mod in ("oneiros_hook", "select_n_hook", "ellm_buffer"):
    try:
        importlib.import_module(f"{__package__}.{_mod}")
        AVAILABLE[_mod] = True
    except ImportError:  # pragma: no cover - a mechanism not written yet
        AVAILABLE[_mod] = False

__all__ = ["mechanism_counters", "AVAILABLE"]


def _unwrap(sched):
    while hasattr(sched, "inner"):
        sched = sched.inner
    return sched


def mechanism_counters(sim) -> dict[str, Any]:
    """How much each mechanism did in a finished run (0 = never acted)."""
    out: dict[str, Any] = {
        "swiftcache_tier_hit_blocks": 0,
        "swiftcache_lent_blocks_max": 0,
        "oneiros_remaps": 0,
        "select_n_host_layers": 0,
        "ellm_inflation_blocks_max": 0,
        "layer_streaming_layers": 0,
        "arbiter_idle_peer_gb": 0.0,
        "arbiter_return_gb": 0.0,
        "arbiter_surplus_gb": 0.0,
    }
    for inst in sim.instances:
        for h in inst.hooks:
            kind = type(h).__name__
            if kind == "SwiftCacheHook":
                st = h.stats()
                out["swiftcache_tier_hit_blocks"] += st["tier_hit_blocks"]
                out["swiftcache_lent_blocks_max"] += sum(w["max_donated_blocks"] for w in st["workers"].values())
            elif kind == "OneirosHook":
                st = (getattr(h, "stats", None) or h.report)()
                out["oneiros_remaps"] = max(out["oneiros_remaps"], st.get("gpu_remaps", 0))
            elif kind == "SelectNHook":
                out["select_n_host_layers"] += int(getattr(h, "n_off", 0))
            elif kind == "LayerStreamingHook":
                out["layer_streaming_layers"] += h.layers
        s = _unwrap(inst.scheduler)
        if hasattr(s, "max_lent"):
            out["ellm_inflation_blocks_max"] += max(s.max_lent, 0)
    arb = getattr(sim, "arbiter", None)
    if arb is not None:
        moved = arb.policy.moved
        from memory_ext.policy.arbiter import Tier

        out["arbiter_idle_peer_gb"] = moved[Tier.IDLE_PEER] / 1e9
        out["arbiter_return_gb"] = moved[Tier.RETURN] / 1e9
        out["arbiter_surplus_gb"] = moved[Tier.SURPLUS] / 1e9
    return out
