"""Unified physical-memory pool: one ledger of chunks with one owner each, and
elastic tensors whose backing grows and shrinks chunk by chunk.

    from memory_ext.vmm import host_backend
    from memory_ext.pool import ChunkPool, KVETensor, Owner
    pool = ChunkPool(host_backend(1 << 21), capacity_chunks=64)
    kv = KVETensor(pool, page_bytes=1 << 16, num_pages=4096)
    kv.ensure_mapped([0, 1, 2])

Mechanisms only: which pages, which owner, how many chunks are a policy's
choice. See ``ownership``, ``slots``, ``kv_etensor`` (with pre-mapping and
``unmapper`` for asynchronous unmapping), ``activation_etensor``, ``arbiter``
(one pool shared by several processes) and docs/memory-pool.md.
"""

from .activation_etensor import ActivationBlock, ActivationETensor
from .arbiter import Arbiter
from .arbiter_client import ArbiterClient, ArbiterDenied, ArbiterError
from .kv_etensor import KVETensor
from .layered_kv import LayeredKVBuffers
from .lent_pool import LentPool
from .ownership import CeilingExceeded, ChunkPool, FloorViolation, Owner, OwnershipError, PoolError, PoolExhausted
from .unmapper import AsyncUnmapper

__all__ = [
    "ActivationBlock",
    "ActivationETensor",
    "Arbiter",
    "ArbiterClient",
    "ArbiterDenied",
    "ArbiterError",
    "AsyncUnmapper",
    "CeilingExceeded",
    "ChunkPool",
    "FloorViolation",
    "KVETensor",
    "LayeredKVBuffers",
    "LentPool",
    "Owner",
    "OwnershipError",
    "PoolError",
    "PoolExhausted",
]
