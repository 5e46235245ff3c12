"""Unified physical-memory pool: one ledger of chunks with one owner each, the
buffers whose backing grows and shrinks chunk by chunk, and the per-device
arbiter that lets several processes share one budget.

    from memory_ext.vmm import host_backend
    from memory_ext.pool import ChunkPool, LayeredKVBuffers
    pool = ChunkPool(host_backend(1 << 16), capacity_chunks=64)
    kv = LayeredKVBuffers(pool, row_bytes=[256] * 8, num_rows=4096, page_size=16)
    kv.map_groups([0, 1])

Mechanisms only: which groups, which owner, how many chunks are a policy's
choice. Modules: ``ownership`` (the chunk ledger), ``slots`` (a reserved range
backed slot by slot), ``layered_kv`` (per-layer KV buffers backed group by
group), ``activation_balloon`` (the activation side of a KV pool, eLLM
ballooning), ``activation_meter`` (peak activation bytes of a forward),
``segment_arena`` (CUDA: torch's MemPool over pool chunks), ``host_kv_buffer``
(KV parked in host memory), ``arbiter`` / ``arbiter_client`` /
``arbiter_protocol`` / ``lent_pool`` (one device budget shared by processes).
See docs/memory-pool.md.
"""

from .arbiter import Arbiter
from .arbiter_client import ArbiterClient, ArbiterDenied, ArbiterError
from .ownership import (
    CeilingExceeded,
    ChunkPool,
    FloorViolation,
    Owner,
    OwnershipError,
    PoolError,
    PoolExhausted,
)


def __getattr__(name: str):
    """``LayeredKVBuffers`` and ``LentPool`` (torch) load on first use: the arbiter process,
    started as ``python -m memory_ext.pool.arbiter``, starts without importing torch."""
    if name == "LayeredKVBuffers":
        from .layered_kv import LayeredKVBuffers

        return LayeredKVBuffers
    if name == "LentPool":
        from .lent_pool import LentPool

        return LentPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Arbiter",
    "ArbiterClient",
    "ArbiterDenied",
    "ArbiterError",
    "CeilingExceeded",
    "ChunkPool",
    "FloorViolation",
    "LayeredKVBuffers",
    "LentPool",
    "Owner",
    "OwnershipError",
    "PoolError",
    "PoolExhausted",
]
