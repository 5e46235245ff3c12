"""ElasticKV: the engine-free KV space (``memory_ext.pool.kv_space.KVSpace``) over upstream's
token allocator, plus the server-side state memx keeps with it.

Upstream's allocators (``TokenToKVPoolAllocator`` for page size 1,
``PagedTokenToKVPoolAllocator`` otherwise) hand out page ids from a free list (plus pages staged
by ``free``). ``UpstreamFreeList`` gives the space the few operations it needs on that free list
(count, append page ranges, drop groups, reset, free pages per group), through
``upstream.kv``; the space's methods take the allocator as the free list's handle. The invariant
and the grow / shrink / premap rules are the space's (``kv_space``'s docstring).

The device's mechanisms (shared-pool link, host buffer, ...) are not attached here: the
coordinator holds them as typed components (``coordinator.device``).
Not thread-safe: called from the scheduler thread only.
"""

from __future__ import annotations

import torch

from memory_ext.pool.kv_space import KVSpace
from memory_ext.pool.layered_kv import LayeredKVBuffers
from sglang_memx.upstream import kv as up_kv


class UpstreamFreeList:
    """``kv_space.FreeListOps`` over upstream's token allocators (the handle is the allocator)."""

    def __init__(self, device):
        self.device = device

    def count(self, allocator) -> int:
        return up_kv.free_page_count(allocator)

    def append_ranges(self, allocator, ranges: list[tuple[int, int]]) -> None:
        pages = [up_kv.free_pages(allocator)]
        pages += [torch.arange(start, end, dtype=torch.int64, device=self.device) for start, end in ranges]
        up_kv.set_free_pages(allocator, torch.cat(pages))

    def drop_groups(self, allocator, groups: list[int], group_pages: int) -> None:
        free = up_kv.free_pages(allocator)
        drop = torch.isin(free // group_pages, torch.tensor(groups, dtype=torch.int64, device=free.device))
        up_kv.set_free_pages(allocator, free[~drop])

    def reset(self, allocator, start: int, end: int) -> None:
        up_kv.set_free_pages(allocator, torch.arange(start, end, dtype=torch.int64, device=self.device))
        up_kv.clear_staged_frees(allocator, self.device)

    def free_per_group(self, allocator, group_pages: int, num_groups: int) -> list[int]:
        up_kv.merge_staged_frees(allocator)
        return self.counts_per_group(allocator, group_pages, num_groups)

    def counts_per_group(self, allocator, group_pages: int, num_groups: int) -> list[int]:
        pages = up_kv.all_free_pages(allocator)  # no merge: upstream's sort of the staged frees is not needed to count
        if pages is None or pages.numel() == 0:
            return [0] * num_groups
        return torch.bincount(pages // group_pages, minlength=num_groups).tolist()

    def groups_with_free_pages(self, allocator, group_pages: int) -> list[int]:
        pages = up_kv.all_free_pages(allocator)
        if pages is None or pages.numel() == 0:
            return []
        return torch.unique(pages // group_pages).tolist()


class ElasticKV(KVSpace):
    def __init__(
        self,
        buffers: LayeredKVBuffers,
        page_size: int,
        num_pages: int,
        *,
        spare_groups: int = 0,
        device="cpu",
    ):
        super().__init__(buffers, page_size, num_pages, UpstreamFreeList(device), spare_groups=spare_groups)
        self.device = device
        self.slab = None  # SlabFormat of this server's groups (elastic.slab), set by the build
        self.cell: dict = {}  # its KV cell (dtype, layers, KV heads, head dims, F2 token size)
        # scheduler-side state: borrow back-off and wake-up (shared pool, ``shared_pool``), one-time length cap
        self.borrow_backoff_until = 0.0
        self.borrow_backoff_s = 0.0
        self.cache_keep_until = 0.0  # shared pool: no borrow to keep cached prefixes before this time
        self.lengths_capped = False
        self.lent_wakeup_registered = False
