"""Turning cached prefixes and free pages back into FREE chunks.

``free_groups`` is the one way memx makes room in the pool from KV: it unmaps
empty groups and evicts cached prefixes (LRU, upstream's own eviction) until
enough whole groups are empty. Used by activation deflation, reclaims from the
arbiter and the host buffer's fetch.
"""

from __future__ import annotations

from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import radix as up_radix


def free_groups(kv: ElasticKV, allocator, tree, groups: int) -> int:
    """Unmap up to ``groups`` free KV groups into FREE, evicting cached prefixes as needed.

    Cached pages of one group may be spread over the LRU order, so eviction continues until
    enough whole groups are empty (or nothing evictable is left). Returns groups unmapped.
    """
    freed = kv.shrink(allocator, max_groups=groups, spare_groups=0)
    while freed < groups and up_radix.evict(tree, (groups - freed) * kv.buffers.group_rows) > 0:
        freed += kv.shrink(allocator, max_groups=groups - freed, spare_groups=0)
    return freed


def idle_kv_chunks(kv: ElasticKV, allocator, tree) -> int:
    """KV chunks that could become FREE now: empty groups, plus the groups evicting the cached
    pages could empty (``ElasticKV.emptiable_groups``; ``tree`` None: empty groups only)."""
    evictable_pages = up_radix.evictable_tokens(tree) // kv.page_size
    return kv.emptiable_groups(allocator, evictable_pages) * kv.buffers.chunks_per_group
