"""The /memx/status document.

``scheduler_status`` runs inside a scheduler process and reads live numbers
from it; ``status_document`` runs in the HTTP process and combines the
per-rank answers. Both return JSON-ready builtins only.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sglang_memx import __version__
from sglang_memx.config import MemxConfig
from sglang_memx.runtime import upstream_version


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def kv_buffer_bytes(kvcache) -> int:
    """Exact bytes of the pool's K/V buffers; falls back to upstream's GB figure."""
    total = 0
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        buffers = getattr(kvcache, name, None)
        if buffers is None:
            continue
        for t in buffers if isinstance(buffers, (list, tuple)) else [buffers]:
            total += t.numel() * t.element_size()
    if total:
        return total
    return int(round(float(getattr(kvcache, "mem_usage", 0.0)) * (1 << 30)))


def kv_pool_status(scheduler) -> dict[str, Any]:
    """Token accounting of the scheduler's KV pool (same formula as upstream's log line)."""
    allocator = scheduler.token_to_kv_pool_allocator
    capacity = int(scheduler.max_total_num_tokens)
    available = int(allocator.available_size())
    tree_cache = getattr(scheduler, "tree_cache", None)
    evictable = int(tree_cache.evictable_size()) if tree_cache is not None else 0
    used = capacity - available - evictable
    kvcache = allocator.get_kvcache()
    elastic = getattr(allocator, "_memx_elastic", None)
    return {
        "kind": type(kvcache).__name__,
        "capacity_tokens": capacity,
        "used_tokens": used,
        "available_tokens": available,
        "evictable_tokens": evictable,
        "usage": round(used / capacity, 6) if capacity else 0.0,
        "page_size": int(scheduler.page_size),
        "dtype": _dtype_name(getattr(kvcache, "dtype", None)),
        "store_dtype": _dtype_name(getattr(kvcache, "store_dtype", None)),
        "device": str(getattr(kvcache, "device", "unknown")),
        "layers": getattr(kvcache, "layer_num", None),
        "bytes": elastic.buffers.mapped_bytes if elastic is not None else kv_buffer_bytes(kvcache),
    }


def request_status(scheduler) -> dict[str, int]:
    running = getattr(scheduler, "running_batch", None)
    waiting = getattr(scheduler, "waiting_queue", None)
    return {
        "running": len(running.reqs) if running is not None and running.reqs is not None else 0,
        "waiting": len(waiting) if waiting is not None else 0,
    }


def elastic_status(allocator) -> dict[str, Any] | None:
    """Physical side of elastic KV: groups, bytes per owner, map/unmap counts, shared-pool traffic."""
    kv = getattr(allocator, "_memx_elastic", None)
    if kv is None:
        return None
    pool = kv.buffers.pool
    chunk = pool.chunk_bytes
    doc = kv.status()
    doc["owners_bytes"] = {str(o).lower(): n * chunk for o, n in pool.usage().items()}
    doc["pool_capacity_bytes"] = pool.capacity_chunks * chunk
    doc["backend"] = pool.backend.counters()
    doc["shared_pool"] = kv.lent.status() if kv.lent is not None else None
    if kv.lent is not None:
        doc["shared_pool"]["chunk_bytes"] = chunk
    return doc


def scheduler_status(scheduler, config: MemxConfig) -> dict[str, Any]:
    doc = {
        "pid": os.getpid(),
        "time": time.time(),
        "features": config.features,
        "kv_pool": kv_pool_status(scheduler),
        "requests": request_status(scheduler),
    }
    elastic = elastic_status(scheduler.token_to_kv_pool_allocator)
    if elastic is not None:
        doc["elastic_kv"] = elastic
    if config.pool:
        doc["pool_name"] = config.pool
    return doc


def status_document(config: MemxConfig, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine per-rank scheduler answers; ranks without a memx section are reported as such."""
    ranks = [state.get("memx") for state in rank_states]  # upstream answers in DP-rank order
    missing = [i for i, r in enumerate(ranks) if r is None]
    return {
        "memx_version": __version__,
        "sglang_version": upstream_version(),
        "enabled": not config.disabled,
        "features": config.features,
        "schedulers": [dict(r, dp_rank=i) for i, r in enumerate(ranks) if r is not None],
        "ranks_without_memx": missing,
    }
