"""ElasticKV: keeps an upstream token allocator's free list inside the mapped KV groups.

Upstream's allocators (``TokenToKVPoolAllocator`` for page size 1,
``PagedTokenToKVPoolAllocator`` otherwise) hand out page ids from a free list
(``free_pages`` plus pages staged by ``free``; ``merge_and_sort_free`` folds
the staged ones in). With elastic KV the KV buffers are views over
``LayeredKVBuffers``, and this class maintains one invariant:

    every page id in the allocator's free lists, and every page a request
    holds, lies in a mapped group.

Unmapped groups are simply absent from the free lists. Then upstream's page
choice (any page of its free list) never touches a hole, whatever its
allocation order. The controller moves pages in and out:

* ``grow(allocator, pages)`` maps the lowest unmapped groups (as the pool
  allows) until the free list has ``pages`` pages, appending their pages;
* ``shrink(allocator)`` removes every mapped group whose pages are *all*
  free from the free list and unmaps it (returning its chunks to the pool),
  keeping ``spare_groups`` such groups mapped for the next burst. Group 0
  holds the padded page 0 (upstream's dummy-write slot) and is never unmapped;
* ``growable_pages()`` is how many pages ``grow`` can add right now: the
  scheduler's notion of "available" is ``free list + growable`` so admission
  and retraction see physical memory, never a promise the pool cannot keep.

Page ``p`` covers token rows ``[p * page_size, (p + 1) * page_size)``; its
group is ``p // group_pages``. Logical pages are ``1 .. num_pages`` (page 0
is reserved), exactly the allocator's own range.

Not thread-safe: called from the scheduler thread only (the pool is).
"""

from __future__ import annotations

import time

import torch

from memory_ext.pool import CeilingExceeded, PoolExhausted
from memory_ext.pool.layered_kv import LayeredKVBuffers


class ElasticKV:
    def __init__(
        self,
        buffers: LayeredKVBuffers,
        page_size: int,
        num_pages: int,
        *,
        spare_groups: int = 0,
        lent=None,
        device="cpu",
    ):
        if buffers.group_rows % page_size:
            raise ValueError(f"group_rows {buffers.group_rows} is not a multiple of page_size {page_size}")
        self.buffers = buffers
        self.page_size = page_size
        self.num_pages = num_pages  # logical pages 1..num_pages
        self.group_pages = buffers.group_rows // page_size
        self.spare_groups = spare_groups
        self.lent = lent  # LentPool when the pool is shared, else None
        self.activation = None  # ActivationBalloon sharing the pool, or None
        self.host = None  # HostBufferState (--memx-host-buffer-gb), or None
        self.device = device
        last_page = num_pages  # highest logical page id
        self.num_groups = last_page // self.group_pages + 1
        if self.num_groups > buffers.num_groups:
            raise ValueError(f"{self.num_groups} groups needed but the buffers have {buffers.num_groups}")
        self._last_group_pages = last_page - (self.num_groups - 1) * self.group_pages + 1
        self.stats = {
            "grow_calls": 0,
            "groups_mapped_total": 0,
            "groups_unmapped_total": 0,
            "grow_refused": 0,
            "map_seconds": 0.0,
            "unmap_seconds": 0.0,
            "max_map_seconds": 0.0,
            "max_unmap_seconds": 0.0,
        }
        # scheduler-side driver state (elastic.driver): borrow back-off, one-time length cap
        self.borrow_backoff_until = 0.0
        self.borrow_backoff_s = 0.0
        self.lengths_capped = False
        buffers.map_groups([0])  # the padded page 0 must always be writable

    # ----------------------------------------------------------- geometry
    def pages_of_group(self, g: int) -> torch.Tensor:
        start = max(g * self.group_pages, 1)
        end = min((g + 1) * self.group_pages, self.num_pages + 1)
        return torch.arange(start, end, dtype=torch.int64, device=self.device)

    def usable_pages(self, g: int) -> int:
        """Allocatable pages of group ``g`` (group 0 loses page 0; the last may be partial)."""
        if self.num_groups == 1:
            return self.num_pages
        if g == 0:
            return self.group_pages - 1
        if g == self.num_groups - 1:
            return self._last_group_pages
        return self.group_pages

    # --------------------------------------------------------------- info
    def unmapped_groups(self) -> list[int]:
        mapped = set(self.buffers.mapped_groups())
        return [g for g in range(self.num_groups) if g not in mapped]

    def affordable_groups(self) -> int:
        """Groups the pool could back right now (FREE chunks plus idle activation chunks)."""
        idle = self.activation.idle() if self.activation is not None else 0
        return (self.buffers.pool.available() + idle) // self.buffers.chunks_per_group

    def growable_pages(self) -> int:
        """Pages ``grow`` could add now: the lowest affordable unmapped groups."""
        unmapped = self.num_groups - self.buffers.num_mapped
        k = min(unmapped, self.affordable_groups())
        if k <= 0:
            return 0
        pages = k * self.group_pages
        last = self.num_groups - 1
        if k == unmapped and not self.buffers.is_mapped(last):
            pages -= self.group_pages - self.usable_pages(last)
        return pages

    @staticmethod
    def free_page_count(allocator) -> int:
        staged = getattr(allocator, "num_staged_pages", None)
        if staged is None:
            staged = len(allocator.release_pages)
        return len(allocator.free_pages) + staged

    # ---------------------------------------------------------- mutations
    def _timed(self, kind: str, fn, groups) -> int:
        t0 = time.perf_counter()
        n = fn(groups)
        dt = time.perf_counter() - t0
        self.stats[f"{kind}_seconds"] += dt
        self.stats[f"max_{kind}_seconds"] = max(self.stats[f"max_{kind}_seconds"], dt)
        return n

    def restrict_free_list(self, allocator) -> None:
        """After the allocator's ``clear()`` (every page free): unmap what may go, keep mapped pages only."""
        victims = [g for g in self.buffers.mapped_groups() if g != 0]
        keep = victims[: self.spare_groups]
        victims = victims[self.spare_groups :]
        if victims:
            self.stats["groups_unmapped_total"] += self._timed("unmap", self.buffers.unmap_groups, victims)
        pages = [self.pages_of_group(g) for g in [0] + keep]
        allocator.free_pages = torch.cat(pages)
        if hasattr(allocator, "release_pages"):
            allocator.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    def grow(self, allocator, pages_wanted: int) -> int:
        """Map groups until the free list holds ``pages_wanted`` pages (or the pool refuses); return groups mapped."""
        missing = pages_wanted - self.free_page_count(allocator)
        if missing <= 0:
            return 0
        self.stats["grow_calls"] += 1
        chosen, pages = [], 0
        for g in self.unmapped_groups():
            if pages >= missing:
                break
            chosen.append(g)
            pages += self.usable_pages(g)
        chosen = chosen[: self.affordable_groups()]
        if chosen and self.activation is not None:  # inflation: KV takes idle activation chunks
            self.activation.lend_to_kv(len(chosen) * self.buffers.chunks_per_group - self.buffers.pool.available())
        mapped: list[int] = []
        while chosen:
            try:
                self._timed("map", self.buffers.map_groups, chosen)
                mapped = chosen
                break
            except (PoolExhausted, CeilingExceeded):
                self.stats["grow_refused"] += 1
                chosen = chosen[:-1]
        if not mapped:
            return 0
        self.stats["groups_mapped_total"] += len(mapped)
        allocator.free_pages = torch.cat([allocator.free_pages] + [self.pages_of_group(g) for g in mapped])
        return len(mapped)

    def shrink(self, allocator, max_groups: int | None = None, spare_groups: int | None = None) -> int:
        """Unmap mapped groups whose pages are all free (highest first), keeping spares; return how many."""
        spare = self.spare_groups if spare_groups is None else spare_groups
        if self.buffers.num_mapped <= 1 + spare:
            return 0
        empty = self.empty_groups(allocator)
        victims = empty[: max(0, len(empty) - spare)]
        if max_groups is not None:
            victims = victims[:max_groups]
        if not victims:
            return 0
        free = allocator.free_pages
        drop = torch.isin(free // self.group_pages, torch.tensor(victims, dtype=torch.int64, device=free.device))
        allocator.free_pages = free[~drop]
        n = self._timed("unmap", self.buffers.unmap_groups, victims)
        self.stats["groups_unmapped_total"] += n
        return n

    def empty_groups(self, allocator) -> list[int]:
        """Mapped groups other than 0 whose pages are all free, highest first (merges staged frees).

        A group can only be empty if at least its usable pages are free: that skips the O(free pages) scan.
        """
        if self.buffers.num_mapped <= 1 or self.free_page_count(allocator) < min(
            self.group_pages, self._last_group_pages
        ):
            return []
        allocator.merge_and_sort_free()
        counts = torch.bincount(allocator.free_pages // self.group_pages, minlength=self.num_groups).tolist()
        empty = [g for g in self.buffers.mapped_groups() if g != 0 and counts[g] == self.usable_pages(g)]
        return sorted(empty, reverse=True)

    # ------------------------------------------------------------ checks
    def logical_free_pages(self, allocator) -> int:
        """Free pages in the logical sense (mapped free + every page of unmapped groups)."""
        return self.free_page_count(allocator) + sum(self.usable_pages(g) for g in self.unmapped_groups())

    def check(self, allocator) -> None:
        """Raise AssertionError if a free page lies outside the mapped groups (the class invariant)."""
        pages = allocator.get_all_free_pages()
        if pages is None or pages.numel() == 0:
            return
        groups = torch.unique(pages // self.group_pages).tolist()
        mapped = set(self.buffers.mapped_groups())
        bad = [g for g in groups if g not in mapped]
        if bad:
            raise AssertionError(f"free pages in unmapped groups {bad[:8]}")
        self.buffers.check_invariants()

    def status(self) -> dict:
        b = self.buffers
        return {
            "group_tokens": b.group_rows,
            "group_bytes": b.group_bytes,
            "groups_total": self.num_groups,
            "groups_mapped": b.num_mapped,
            "mapped_bytes": b.mapped_bytes,
            "logical_bytes": self.num_groups * b.group_bytes,
            "chunk_bytes": b.pool.chunk_bytes,
            "chunks_per_group": b.chunks_per_group,
            "spare_groups": self.spare_groups,
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()},
            "activation": self.activation.status() if self.activation is not None else None,
            "host_buffer": self.host.status() if self.host is not None else None,
        }
