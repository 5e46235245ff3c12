"""X1: several memory mechanisms on one node, composed (scenario
``combined_x1``), and the registration point of the SwiftCache hook.

Importing this module registers ``swiftcache`` (``swiftcache_hook``) and
imports the other mechanism modules that exist (``oneiros_hook``,
``select_n_hook``, ``ellm_buffer``) so that their kinds are registered too.

The "arbiter" here is the composition rule the mechanisms already obey in
the simulator, stated once:

* every capacity change goes through ``inst.kv.resize``, which never takes a
  block in use -- so a SwiftCache worker lends only blocks that are idle
  *after* whatever Oneiros / Select-N / eLLM gave that instance, and a lender
  that needs memory back reclaims it (Alg. 1 SCALEUP) before it is short;
* link use is arbitrated by the fair-share links: weight streaming
  (Oneiros / Select-N) and host-tier traffic share ``h2d``/``d2h``, peer
  KV traffic uses NVLink, so the mechanisms only contend where they share a
  physical link.

``mechanism_counters(sim)`` reports, per mechanism, a counter that is > 0
when that mechanism acted in a run (used by the test and the docs).
A single node-wide arbiter object that *trades* memory between mechanisms
(e.g. preferring peer KV over remapping weights) is not implemented.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from . import swiftcache_hook  # noqa: F401  (registers "swiftcache")

AVAILABLE: Dict[str, bool] = {}
for _mod in ("oneiros_hook", "select_n_hook", "ellm_buffer"):
    try:
        importlib.import_module(f"{__package__}.{_mod}")
        AVAILABLE[_mod] = True
    except ImportError:  # pragma: no cover - a mechanism not written yet
        AVAILABLE[_mod] = False

__all__ = ["mechanism_counters", "AVAILABLE"]


def mechanism_counters(sim) -> Dict[str, Any]:
    """How much each mechanism did in a finished run (0 = never acted)."""
    out: Dict[str, Any] = {"swiftcache_tier_hit_blocks": 0, "swiftcache_lent_blocks_max": 0,
                           "oneiros_remaps": 0, "select_n_host_layers": 0, "ellm_inflation_blocks_max": 0,
                           "layer_streaming_layers": 0}
    for inst in sim.instances:
        for h in inst.hooks:
            kind = type(h).__name__
            if kind == "SwiftCacheHook":
                st = h.stats()
                out["swiftcache_tier_hit_blocks"] += st["tier_hit_blocks"]
                out["swiftcache_lent_blocks_max"] += sum(w["max_donated_blocks"] for w in st["workers"].values())
            elif kind == "OneirosHook":
                st = (getattr(h, "stats", None) or getattr(h, "report"))()
                out["oneiros_remaps"] = max(out["oneiros_remaps"], st.get("gpu_remaps", 0))
            elif kind == "SelectNHook":
                out["select_n_host_layers"] += int(getattr(h, "n_off", 0))
            elif kind == "LayerStreamingHook":
                out["layer_streaming_layers"] += h.layers
        s = inst.scheduler
        s = getattr(s, "inner", s)
        if hasattr(s, "max_lent"):
            out["ellm_inflation_blocks_max"] += s.max_lent
    return out
