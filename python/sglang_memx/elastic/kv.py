"""ElasticKV: keeps an upstream token allocator's free list inside the mapped KV groups.

Upstream's allocators (``TokenToKVPoolAllocator`` for page size 1,
``PagedTokenToKVPoolAllocator`` otherwise) hand out page ids from a free list
(plus pages staged by ``free``). With elastic KV the KV buffers are views over
``LayeredKVBuffers``, and this class maintains one invariant:

    every page id in the allocator's free lists, and every page a request
    holds, lies in a mapped group.

Unmapped groups are simply absent from the free lists, so upstream's page
choice (any page of its free list) never touches a hole. Pages move in and out:

* ``grow(allocator, pages, path)`` maps the lowest unmapped groups (as the pool
  allows) until the free list has ``pages`` pages. ``path`` says who asked:
  ``"request"`` (upstream's allocation, on the request path) or ``"premap"``
  (memx's tick, before the batch is picked); ``map_calls[path]`` counts the
  groups each mapped, and ``note_forward`` attributes the request path's
  maps since the previous forward to the forward about to run (allocation
  precedes the forward), counting those of decode forwards (``decode_steps``,
  ``decode_steps_with_map``, ``decode_map_calls``).
* Unmaps are counted by ``phase`` (``unmap_calls``): ``"tick"`` while memx's tick runs
  (``coordinator.tick`` sets it: routine deflation, reclaims, background work) and ``"request"``
  otherwise (the scheduler's own path: admission, a decode step's activation reserve and
  capacity check, allocation). ``note_forward`` attributes the request path's unmaps since
  the previous forward to a decode forward as it does maps (``decode_unmap_calls``,
  ``decode_steps_with_unmap``): a decode step's path is everything between the previous
  forward and it outside the tick, so ``decode_map_calls + decode_unmap_calls`` are the
  driver calls (in groups) a steady decode step waited on.
* ``refill(allocator, pages, keep_activation=...)`` is the premap: between
  iterations it maps groups from FREE chunks (idle activation chunks too when
  the caller allows: not while a prefill waits, which would take them back)
  until ``pages`` free pages are ready, so a decode step finds its pages mapped
  and the request path makes no map call. It leaves the next decode step's
  activation (``keep_activation`` chunks) alone, so that step's reserve does
  not unmap what was just premapped.
* ``shrink(allocator, spare_groups=...)`` unmaps mapped groups whose pages are
  *all* free (highest first), keeping ``spare_groups`` of them mapped for the
  next burst. Group 0 holds upstream's padded page 0 and is never unmapped.
* ``growable_pages()`` is how many pages ``grow`` can add right now; the
  scheduler's "available" is ``free list + growable``, so admission and
  retraction see physical memory, never a promise the pool cannot keep.

Page ``p`` covers token rows ``[p * page_size, (p + 1) * page_size)``; its
group is ``p // group_pages``. Logical pages are ``1 .. num_pages``.
Not thread-safe: called from the scheduler thread only.
"""

from __future__ import annotations

import time

import torch

from memory_ext.pool import CeilingExceeded, PoolExhausted
from memory_ext.pool.layered_kv import LayeredKVBuffers
from sglang_memx.upstream import kv as up_kv

PATHS = ("request", "premap")
PHASES = ("request", "tick")


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
        self.spare_groups = spare_groups  # empty mapped groups kept ready while the server has work
        self.lent = lent  # LentPool when the pool is shared, else None
        self.activation = None  # ActivationBalloon sharing the pool, or None
        self.host = None  # HostBufferState (--memx-host-buffer-gb), or None
        self.weights = None  # WeightsState (--memx-weights), or None
        self.layer_stream = None  # peer.layer_stream.LayerStreamSetup (--memx-peer-layer-stream), or None
        self.slab = None  # SlabFormat of this server's groups (elastic.slab), set by the build
        self.cell: dict = {}  # its KV cell (dtype, layers, KV heads, head dims, F2 token size)
        self.device = device
        last_page = num_pages
        self.num_groups = last_page // self.group_pages + 1
        if self.num_groups > buffers.num_groups:
            raise ValueError(f"{self.num_groups} groups needed but the buffers have {buffers.num_groups}")
        self._last_group_pages = last_page - (self.num_groups - 1) * self.group_pages + 1
        self.map_calls = dict.fromkeys(PATHS, 0)
        self.unmap_calls = dict.fromkeys(PHASES, 0)  # groups unmapped, by phase
        self.phase = "request"  # "tick" while coordinator.tick runs
        self.stats = {
            "grow_calls": 0,
            "groups_mapped_total": 0,
            "groups_unmapped_total": 0,
            "grow_refused": 0,
            "map_seconds": 0.0,
            "unmap_seconds": 0.0,
            "max_map_seconds": 0.0,
            "max_unmap_seconds": 0.0,
            "decode_steps": 0,
            "decode_steps_with_map": 0,
            "decode_map_calls": 0,
            "decode_steps_with_unmap": 0,
            "decode_unmap_calls": 0,
            "ticks": 0,
            "tick_seconds": 0.0,
        }
        self._request_maps_seen = 0
        self._request_unmaps_seen = 0
        # scheduler-side state: borrow back-off (shared pool), one-time length cap
        self.borrow_backoff_until = 0.0
        self.borrow_backoff_s = 0.0
        self.cache_keep_until = 0.0  # shared pool: no borrow to keep cached prefixes before this time
        self.lengths_capped = False
        self.lent_wakeup_registered = False
        buffers.map_groups([0])  # the padded page 0 must always be writable
        self._mapped_usable = self.usable_pages(0)  # allocatable pages of the mapped groups
        self._shrink_floor: dict[int, int] = {}  # spare -> free pages when a scan last found nothing

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

    def affordable_groups(self, *, free_only: bool = False, keep_activation: int = 0) -> int:
        """Groups the pool could back right now: FREE chunks, plus idle activation chunks
        unless ``free_only``.

        ``keep_activation``: chunks the activation must still find without deflating KV
        (the premap passes the next decode step's, ``demand.decode_activation_chunks``).
        Invariant: after mapping the groups counted here, ``held + FREE >= keep_activation``
        and no chunk the activation holds below ``keep_activation`` is lent, so the
        reserve that comes next neither unmaps a group nor acquires what KV just took.
        """
        outside = self._outside_chunks(free_only=free_only, keep_activation=keep_activation)
        return outside // self.buffers.chunks_per_group

    def _outside_chunks(self, *, free_only: bool = False, keep_activation: int = 0) -> int:
        """Chunks outside KV that ``affordable_groups`` counts (FREE and, unless ``free_only``, idle
        activation beyond what must stay held)."""
        free = self.buffers.pool.available()
        if self.activation is None:
            return free
        keep = max(self.activation.live, keep_activation)
        held = self.activation.held
        lendable = 0 if free_only else max(0, held - keep)
        return max(0, free - max(0, keep - held)) + lendable

    def growable_pages(self) -> int:
        """Pages ``grow`` could add now: the lowest affordable unmapped groups."""
        return self._growable_for(self.affordable_groups())

    def _growable_for(self, affordable: int) -> int:
        unmapped = self.num_groups - self.buffers.num_mapped
        k = min(unmapped, affordable)
        if k <= 0:
            return 0
        pages = k * self.group_pages
        last = self.num_groups - 1
        if k == unmapped and not self.buffers.is_mapped(last):
            pages -= self.group_pages - self.usable_pages(last)
        return pages

    def activation_cost_pages(self, chunks: int) -> int:
        """Pages the scheduler's available count (free list + ``growable_pages``) loses when the
        activation makes ``chunks`` more chunks live.

        They come from FREE and idle activation chunks first, which count as growable pages only
        in whole groups (so a remainder is free of charge), then from the highest mapped groups
        other than 0, unmapped, each costing its usable pages (the last group may be partial).
        A shortfall beyond those groups is charged a whole group each: it cannot be met."""
        if chunks <= 0:
            return 0
        cpg = self.buffers.chunks_per_group
        outside = self._outside_chunks()
        before = self._growable_for(outside // cpg)
        left = outside - chunks
        if left >= 0:
            return before - self._growable_for(left // cpg)
        groups = -(left // cpg)  # ceil(-left / cpg)
        victims = sorted((g for g in self.buffers.mapped_groups() if 0 < g < self.num_groups), reverse=True)[:groups]
        return before + sum(self.usable_pages(g) for g in victims) + (groups - len(victims)) * self.group_pages

    # ---------------------------------------------------------- mutations
    def _timed(self, kind: str, fn, groups) -> int:
        t0 = time.perf_counter()
        n = fn(groups)
        usable = sum(self.usable_pages(g) for g in groups)
        self._mapped_usable += usable if kind == "map" else -usable
        if kind == "unmap":
            self.unmap_calls[self.phase] += n
        dt = time.perf_counter() - t0
        self.stats[f"{kind}_seconds"] += dt
        self.stats[f"max_{kind}_seconds"] = max(self.stats[f"max_{kind}_seconds"], dt)
        return n

    def restrict_free_list(self, allocator) -> None:
        """After the allocator's ``clear()`` (every page free): unmap what may go, keep mapped pages only."""
        victims = [g for g in self.buffers.mapped_groups() if g != 0]
        if victims:
            self.stats["groups_unmapped_total"] += self._timed("unmap", self.buffers.unmap_groups, victims)
        up_kv.set_free_pages(allocator, self.pages_of_group(0))
        up_kv.clear_staged_frees(allocator, self.device)

    def grow(self, allocator, pages_wanted: int, path: str = "request", *, free_only: bool = False,
             keep_activation: int = 0) -> int:  # fmt: skip
        """Map groups until the free list holds ``pages_wanted`` pages (or the pool refuses); return groups mapped.

        Only groups ``affordable_groups(free_only=..., keep_activation=...)`` counts are mapped:
        idle activation chunks beyond ``keep_activation`` are lent, FREE chunks the activation
        needs to reach it are left."""
        missing = pages_wanted - up_kv.free_page_count(allocator)
        if missing <= 0:
            return 0
        self.stats["grow_calls"] += 1
        chosen, pages = [], 0
        for g in self.unmapped_groups():
            if pages >= missing:
                break
            chosen.append(g)
            pages += self.usable_pages(g)
        chosen = chosen[: self.affordable_groups(free_only=free_only, keep_activation=keep_activation)]
        if chosen and self.activation is not None and not free_only:  # inflation: KV takes idle activation
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
        self.map_calls[path] += len(mapped)
        pages = [up_kv.free_pages(allocator)] + [self.pages_of_group(g) for g in mapped]
        up_kv.set_free_pages(allocator, torch.cat(pages))
        return len(mapped)

    def note_forward(self, decode: bool) -> None:
        """Before each forward: the request path's maps and unmaps since the previous forward were
        made for this one (its batch's activation is reserved and its KV allocated before it runs);
        count them if it is a decode step."""
        maps = self.map_calls["request"] - self._request_maps_seen
        unmaps = self.unmap_calls["request"] - self._request_unmaps_seen
        self._request_maps_seen = self.map_calls["request"]
        self._request_unmaps_seen = self.unmap_calls["request"]
        if decode:
            self.stats["decode_steps"] += 1
            self.stats["decode_map_calls"] += maps
            self.stats["decode_steps_with_map"] += 1 if maps else 0
            self.stats["decode_unmap_calls"] += unmaps
            self.stats["decode_steps_with_unmap"] += 1 if unmaps else 0

    def refill(self, allocator, pages_wanted: int, *, free_only: bool = True, keep_activation: int = 0) -> int:
        """Premap (off the request path): map groups until ``pages_wanted`` pages are free, from FREE
        chunks (and idle activation chunks unless ``free_only``).

        Policy: the premap never takes the chunks the next decode step's activation needs
        (``keep_activation``, see ``affordable_groups``). Taking them made that step's reserve
        deflate the group just premapped: an unmap on the decode step's path, and a map again
        at the next tick (a ping-pong measured on a real server, docs/memory-pool.md)."""
        return self.grow(allocator, pages_wanted, "premap", free_only=free_only, keep_activation=keep_activation)

    def shrink(self, allocator, max_groups: int | None = None, spare_groups: int | None = None,
               lazy: bool = False) -> int:  # fmt: skip
        """Unmap mapped groups whose pages are all free (highest first), keeping spares; return how many.

        ``lazy`` (the tick's routine deflation): skip the scan while the free list has not grown
        since a scan found nothing to unmap. A group emptied by frees that allocations then hid
        waits for the next scan; memory is never lost, only unmapped later."""
        spare = self.spare_groups if spare_groups is None else spare_groups
        if self.buffers.num_mapped <= 1 + spare:
            return 0
        free_count = up_kv.free_page_count(allocator)
        if free_count // min(self.group_pages, self._last_group_pages) <= spare:
            return 0  # fewer free pages than one group beyond the spares: no group can be empty and spare
        if lazy and free_count <= self._shrink_floor.get(spare, -1):
            self._shrink_floor[spare] = free_count
            return 0
        empty = self.empty_groups(allocator)
        victims = empty[: max(0, len(empty) - spare)]
        if max_groups is not None:
            victims = victims[:max_groups]
        if not victims:
            self._shrink_floor[spare] = free_count
            return 0
        free = up_kv.free_pages(allocator)
        drop = torch.isin(free // self.group_pages, torch.tensor(victims, dtype=torch.int64, device=free.device))
        up_kv.set_free_pages(allocator, free[~drop])
        n = self._timed("unmap", self.buffers.unmap_groups, victims)
        self.stats["groups_unmapped_total"] += n
        return n

    def empty_groups(self, allocator) -> list[int]:
        """Mapped groups other than 0 whose pages are all free, highest first (merges staged frees).

        A group can only be empty if at least its usable pages are free: that skips the O(free pages) scan.
        """
        if self.buffers.num_mapped <= 1 or up_kv.free_page_count(allocator) < min(
            self.group_pages, self._last_group_pages
        ):
            return []
        counts = self._free_pages_per_group(allocator)
        empty = [g for g in self.buffers.mapped_groups() if g != 0 and counts[g] == self.usable_pages(g)]
        return sorted(empty, reverse=True)

    def _free_pages_per_group(self, allocator) -> list[int]:
        """Free pages of each group (staged frees merged first): an O(free pages) scan."""
        up_kv.merge_staged_frees(allocator)
        return torch.bincount(up_kv.free_pages(allocator) // self.group_pages, minlength=self.num_groups).tolist()

    def emptiable_groups(self, allocator, evictable_pages: int) -> int:
        """Mapped groups other than 0 that are empty or that evicting at most ``evictable_pages``
        cached pages in all could empty (cheapest first).

        An upper estimate: it assumes the cached pages lie in those groups, so eviction (LRU,
        upstream's order) may empty fewer; callers re-check what eviction freed. Counting whole
        ``group_rows`` of evictable tokens instead would miss a partial last group (one page of
        a server whose capacity is one group) and never evict for it.
        """
        if evictable_pages <= 0:
            return len(self.empty_groups(allocator))
        mapped = [g for g in self.buffers.mapped_groups() if 0 < g < self.num_groups]
        if not mapped:
            return 0
        counts = self._free_pages_per_group(allocator)
        used = sorted(self.usable_pages(g) - counts[g] for g in mapped)
        n = 0
        for u in used:
            if u > evictable_pages:
                break
            evictable_pages -= u
            n += 1
        return n

    # ------------------------------------------------------------ checks
    def logical_free_pages(self, allocator) -> int:
        """Free pages in the logical sense (mapped free + every page of unmapped groups)."""
        return up_kv.free_page_count(allocator) + self.num_pages - self._mapped_usable

    def check(self, allocator) -> None:
        """Raise AssertionError if a free page lies outside the mapped groups (the class invariant)."""
        pages = up_kv.all_free_pages(allocator)
        if pages is None or pages.numel() == 0:
            return
        groups = torch.unique(pages // self.group_pages).tolist()
        mapped = set(self.buffers.mapped_groups())
        bad = [g for g in groups if g not in mapped]
        if bad:
            raise AssertionError(f"free pages in unmapped groups {bad[:8]}")
        self.buffers.check_invariants()

    def status(self) -> dict:
        """The KV space's own numbers; its components add theirs (``coordinator.device.Coordinator.status``)."""
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
            "map_calls": dict(self.map_calls),
            "unmap_calls": dict(self.unmap_calls),
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()},
        }
