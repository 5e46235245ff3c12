"""The /memx/status document.

``scheduler_status`` runs inside a scheduler process and reads live numbers from it;
``status_document`` runs in the HTTP process and combines the per-rank answers. Both
return JSON-ready builtins only.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sglang_memx import __version__, compute_share, heap_trim, router_activity
from sglang_memx.config import MemxConfig
from sglang_memx.coordinator import device
from sglang_memx.coordinator.swa_spaces import SwaSpaces
from sglang_memx.elastic.slab import slab_status
from sglang_memx.peer import server as peer_server
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import radix as up_radix
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream import version


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def kv_pool_status(scheduler) -> dict[str, Any]:
    """Token accounting of the scheduler's KV pool (the formula of upstream's log line)."""
    allocator = up_sched.allocator(scheduler)
    capacity = up_sched.logical_capacity_tokens(scheduler)
    available = up_kv.available_tokens(allocator)
    evictable = up_radix.evictable_tokens(up_sched.tree_cache(scheduler))
    used = capacity - available - evictable
    pool = up_kv.pool_description(allocator)
    coordinator = device.of(allocator)
    return {
        "kind": pool["kind"],
        "capacity_tokens": capacity,
        "used_tokens": used,
        "available_tokens": available,
        "evictable_tokens": evictable,
        "usage": round(used / capacity, 6) if capacity else 0.0,
        "page_size": up_sched.page_size(scheduler),
        "dtype": _dtype_name(pool["dtype"]),
        "store_dtype": _dtype_name(pool["store_dtype"]),
        "device": pool["device"],
        "layers": pool["layers"],
        "bytes": _mapped_bytes(coordinator) if coordinator is not None else pool["bytes"],
    }


def _mapped_bytes(coordinator) -> int:
    """KV bytes backed now: the coordinator's space, and a hybrid sliding-window model's second one."""
    swa = coordinator.part(SwaSpaces)
    return coordinator.kv.buffers.mapped_bytes + (0 if swa is None else swa.swa.buffers.mapped_bytes)


def request_status(scheduler) -> dict[str, int]:
    return {"running": len(up_sched.running_reqs(scheduler)), "waiting": len(up_sched.waiting(scheduler))}


def elastic_status(allocator) -> dict[str, Any] | None:
    """Physical side of elastic KV: groups, bytes per owner, map/unmap counts, each component's
    section (shared-pool traffic, activation, host buffer, weights; None when off), the
    coordinator's components and orders, and the KV slab (its format for this model's KV cell
    and the FREE / PARTIAL / FULL counts)."""
    coordinator = device.of(allocator)
    if coordinator is None:
        return None
    kv = coordinator.kv
    pool = kv.buffers.pool
    chunk = pool.chunk_bytes
    doc = coordinator.status()
    doc["owners_bytes"] = {str(o).lower(): n * chunk for o, n in pool.usage().items()}
    doc["pool_capacity_bytes"] = pool.capacity_chunks * chunk
    doc["backend"] = pool.backend.counters()
    doc["slab"] = slab_status(kv, allocator)
    return doc


def scheduler_status(scheduler, config: MemxConfig, hooks: list[dict[str, Any]]) -> dict[str, Any]:
    """One scheduler's section; ``hooks`` is the hooks' report (``hooks.hooks_status``: the hooks
    package reports itself, status never imports it)."""
    doc = {
        "pid": os.getpid(),
        "time": time.time(),
        "features": config.features,
        "kv_pool": kv_pool_status(scheduler),
        "requests": request_status(scheduler),
        "hooks": hooks,
    }
    elastic = elastic_status(up_sched.allocator(scheduler))
    if elastic is not None:
        doc["elastic_kv"] = elastic
    if config.pool:
        doc["pool_name"] = config.pool
    doc["router_activity"] = router_activity.status()  # None: no router ever posted /memx/activity
    doc["compute_share"] = compute_share.status()  # None: no co-located engines' board
    doc["heap_trim"] = heap_trim.status()  # None: no iteration yet, or no glibc
    peer = peer_server.server_of(scheduler) if config.features["peer_kv"] else None
    if peer is not None:
        doc["peer_kv"] = peer.status()
    return doc


def status_document(config: MemxConfig, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine per-rank scheduler answers; ranks without a memx section are reported as such."""
    ranks = [state.get("memx") for state in rank_states]  # upstream answers in DP-rank order
    missing = [i for i, r in enumerate(ranks) if r is None]
    return {
        "memx_version": __version__,
        "sglang_version": version.installed_sglang(),
        "sglang_supported": version.SUPPORTED_SGLANG,
        "enabled": not config.disabled,
        "features": config.features,
        "schedulers": [dict(r, dp_rank=i) for i, r in enumerate(ranks) if r is not None],
        "ranks_without_memx": missing,
    }
