"""An engine-free KV space: an engine's free list of KV pages kept inside the mapped groups of
``LayeredKVBuffers``, grown and shrunk group by group.

The space knows no engine. The engine's free list is reached through a handle the space never
looks into, by the few operations of ``FreeListOps`` (count, append page ranges, drop groups,
reset, count free pages per group); the engine side implements them over its allocator. One
invariant holds:

    every page in the free list, and every page a request holds, lies in a mapped group.

Unmapped groups are simply absent from the free list, so the engine's page choice (any page
of its free list) never touches a hole. Pages move in and out:

* ``grow(handle, pages, path)`` maps the lowest unmapped groups (as the pool allows) until the
  free list has ``pages`` pages. ``path`` says who asked: ``"request"`` (the engine's
  allocation) or ``"premap"`` (between iterations); ``map_calls[path]`` counts the groups each
  mapped, and ``note_forward`` attributes the request path's maps since the previous forward to
  the forward about to run, counting those of decode forwards (``decode_steps``,
  ``decode_steps_with_map``, ``decode_map_calls``).
* Unmaps are counted by ``phase`` (``unmap_calls``): ``"tick"`` while the per-iteration
  housekeeping runs (its caller sets it) and ``"request"`` otherwise; ``note_forward``
  attributes the request path's unmaps to a decode forward as it does maps
  (``decode_unmap_calls``, ``decode_steps_with_unmap``).
* ``refill(handle, pages, keep_activation=...)`` is the premap: between iterations it maps groups
  from FREE chunks (idle activation chunks too when the caller allows) until ``pages`` free pages
  are ready, leaving the next decode step's activation (``keep_activation`` chunks) alone.
* ``shrink(handle, spare_groups=...)`` unmaps mapped groups whose pages are *all* free (highest
  first), keeping ``spare_groups`` of them mapped for the next burst. Group 0 holds the engine's
  padded page 0 and is never unmapped.
* ``growable_pages()`` is how many pages ``grow`` can add right now; an engine's "available" is
  ``free list + growable``, so admission sees physical memory, never a promise the pool cannot keep.

``activation`` is the activation balloon sharing the pool (``activation_balloon``) or None:
its idle chunks count as affordable and are lent to KV when it grows.

Page ``p`` covers token rows ``[p * page_size, (p + 1) * page_size)``; its group is
``p // group_pages``. Logical pages are ``1 .. num_pages``. Not thread-safe. No torch here:
``memory_ext.pool`` imports without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from memory_ext.pool.ownership import CeilingExceeded, PoolExhausted

PATHS = ("request", "premap")
PHASES = ("request", "tick")


class FreeListOps(Protocol):
    """The operations the space needs on an engine's free list (``handle``: the engine's allocator)."""

    def count(self, handle) -> int:
        """Free pages, staged frees included."""

    def append_ranges(self, handle, ranges: list[tuple[int, int]]) -> None:
        """Append pages ``[start, end)`` of each range to the free list."""

    def drop_groups(self, handle, groups: list[int], group_pages: int) -> None:
        """Remove every free page of ``groups`` (staged frees already merged)."""

    def reset(self, handle, start: int, end: int) -> None:
        """The free list becomes exactly pages ``[start, end)``; staged frees are emptied."""

    def free_per_group(self, handle, group_pages: int, num_groups: int) -> list[int]:
        """Free pages of each group, staged frees merged first."""

    def counts_per_group(self, handle, group_pages: int, num_groups: int) -> list[int]:
        """Free pages of each group, staged frees counted but not merged (a count only: a caller
        that then drops groups from the free list uses ``free_per_group``, which merges)."""

    def groups_with_free_pages(self, handle, group_pages: int) -> list[int]:
        """Groups holding at least one free page (staged frees included)."""


class KVSpace:
    def __init__(self, buffers, page_size: int, num_pages: int, free_list: FreeListOps, *, spare_groups: int = 0):
        if buffers.group_rows % page_size:
            raise ValueError(f"group_rows {buffers.group_rows} is not a multiple of page_size {page_size}")
        self.buffers = buffers
        self.free_list = free_list
        self.page_size = page_size
        self.num_pages = num_pages  # logical pages 1..num_pages
        self.group_pages = buffers.group_rows // page_size
        self.spare_groups = spare_groups  # empty mapped groups kept ready while the server has work
        self.activation = None  # ActivationBalloon sharing the pool, or None
        self.num_groups = num_pages // self.group_pages + 1
        if self.num_groups > buffers.num_groups:
            raise ValueError(f"{self.num_groups} groups needed but the buffers have {buffers.num_groups}")
        self._last_group_pages = num_pages - (self.num_groups - 1) * self.group_pages + 1
        self.map_calls = dict.fromkeys(PATHS, 0)
        self.unmap_calls = dict.fromkeys(PHASES, 0)  # groups unmapped, by phase
        self.phase = "request"  # "tick" while the per-iteration housekeeping runs
        self.stats: dict[str, Any] = {
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
            "admission_reopened": 0,  # upstream's closed admission opened again: the head fits (server)
        }
        self._request_maps_seen = 0
        self._request_unmaps_seen = 0
        buffers.map_groups([0])  # the padded page 0 must always be writable
        self._mapped_usable = self.usable_pages(0)  # allocatable pages of the mapped groups
        self._shrink_floor: dict[int, int] = {}  # spare -> free pages when a scan last found nothing

    # ----------------------------------------------------------- geometry
    def page_range(self, g: int) -> tuple[int, int]:
        """Pages ``[start, end)`` of group ``g`` (page 0 excluded; the last group may be partial)."""
        return max(g * self.group_pages, 1), min((g + 1) * self.group_pages, self.num_pages + 1)

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

        ``keep_activation``: chunks the activation must still find without deflating KV (the
        premap passes the next decode step's). Invariant: after mapping the groups counted here,
        ``held + FREE >= keep_activation`` and no chunk the activation holds below
        ``keep_activation`` is lent, so the reserve that comes next neither unmaps a group nor
        acquires what KV just took.
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

    def groups_to_add(self, pages: int) -> int | None:
        """How many of the lowest unmapped groups ``grow`` must map to add ``pages`` pages (0 for none;
        None: the unmapped groups cannot give that many). O(1): every group is full-size but the last."""
        if pages <= 0:
            return 0
        unmapped = self.num_groups - self.buffers.num_mapped
        k = min(-(-pages // self.group_pages), unmapped)
        return k if k and self._growable_for(k) >= pages else None

    def addable_pages(self) -> int:
        """Pages every unmapped group together would add (the pool's chunks aside)."""
        return self._growable_for(self.num_groups - self.buffers.num_mapped)

    def activation_cost_pages(self, chunks: int) -> int:
        """Pages the available count (free list + ``growable_pages``) loses when the activation
        makes ``chunks`` more chunks live.

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

    def restrict_free_list(self, handle) -> None:
        """After the engine cleared its free list (every page free): unmap what may go, keep the
        mapped pages only (those of group 0)."""
        victims = [g for g in self.buffers.mapped_groups() if g != 0]
        if victims:
            self.stats["groups_unmapped_total"] += self._timed("unmap", self.buffers.unmap_groups, victims)
        self.free_list.reset(handle, *self.page_range(0))

    def grow(self, handle, pages_wanted: int, path: str = "request", *, free_only: bool = False,
             keep_activation: int = 0) -> int:  # fmt: skip
        """Map groups until the free list holds ``pages_wanted`` pages (or the pool refuses); return groups mapped.

        Only groups ``affordable_groups(free_only=..., keep_activation=...)`` counts are mapped:
        idle activation chunks beyond ``keep_activation`` are lent, FREE chunks the activation
        needs to reach it are left."""
        missing = pages_wanted - self.free_list.count(handle)
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
        self.free_list.append_ranges(handle, [self.page_range(g) for g in mapped])
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

    def refill(self, handle, pages_wanted: int, *, free_only: bool = True, keep_activation: int = 0) -> int:
        """Premap (off the request path): map groups until ``pages_wanted`` pages are free, from FREE
        chunks (and idle activation chunks unless ``free_only``).

        Policy: the premap never takes the chunks the next decode step's activation needs
        (``keep_activation``, see ``affordable_groups``). Taking them made that step's reserve
        deflate the group just premapped: an unmap on the decode step's path, and a map again
        at the next tick (a ping-pong measured on a real server, docs/memory-pool.md)."""
        return self.grow(handle, pages_wanted, "premap", free_only=free_only, keep_activation=keep_activation)

    def shrink(self, handle, max_groups: int | None = None, spare_groups: int | None = None,
               lazy: bool = False) -> int:  # fmt: skip
        """Unmap mapped groups whose pages are all free (highest first), keeping spares; return how many.

        ``lazy`` (the tick's routine deflation): skip the scan while the free list has not grown
        since a scan found nothing to unmap. A group emptied by frees that allocations then hid
        waits for the next scan; memory is never lost, only unmapped later."""
        spare = self.spare_groups if spare_groups is None else spare_groups
        if self.buffers.num_mapped <= 1 + spare:
            return 0
        free_count = self.free_list.count(handle)
        if free_count // min(self.group_pages, self._last_group_pages) <= spare:
            return 0  # fewer free pages than one group beyond the spares: no group can be empty and spare
        if lazy and free_count <= self._shrink_floor.get(spare, -1):
            self._shrink_floor[spare] = free_count
            return 0
        empty = self.empty_groups(handle)
        victims = empty[: max(0, len(empty) - spare)]
        if max_groups is not None:
            victims = victims[:max_groups]
        if not victims:
            self._shrink_floor[spare] = free_count
            return 0
        self.free_list.drop_groups(handle, victims, self.group_pages)
        n = self._timed("unmap", self.buffers.unmap_groups, victims)
        self.stats["groups_unmapped_total"] += n
        return n

    def empty_groups(self, handle) -> list[int]:
        """Mapped groups other than 0 whose pages are all free, highest first (merges staged frees).

        A group can only be empty if at least its usable pages are free: that skips the O(free pages) scan.
        """
        if self.buffers.num_mapped <= 1 or self.free_list.count(handle) < min(self.group_pages, self._last_group_pages):
            return []
        counts = self.free_list.free_per_group(handle, self.group_pages, self.num_groups)
        empty = [g for g in self.buffers.mapped_groups() if g != 0 and counts[g] == self.usable_pages(g)]
        return sorted(empty, reverse=True)

    def emptiable_groups(self, handle, evictable_pages: int) -> int:
        """Mapped groups other than 0 that are empty or that evicting at most ``evictable_pages``
        cached pages in all could empty (cheapest first).

        An upper estimate: it assumes the cached pages lie in those groups, so eviction (LRU,
        the engine's order) may empty fewer; callers re-check what eviction freed. Counting whole
        ``group_rows`` of evictable tokens instead would miss a partial last group (one page of
        a server whose capacity is one group) and never evict for it. A count: staged frees are
        counted, not merged (this runs at every report to the arbiter; upstream sorts them when it
        needs them).
        """
        mapped = [g for g in self.buffers.mapped_groups() if 0 < g < self.num_groups]
        if not mapped:
            return 0
        if evictable_pages <= 0 and self.free_list.count(handle) < min(self.group_pages, self._last_group_pages):
            return 0  # no group can be all free: skip the O(free pages) count (as ``empty_groups``)
        evictable_pages = max(0, evictable_pages)
        counts = self.free_list.counts_per_group(handle, self.group_pages, self.num_groups)
        used = sorted(self.usable_pages(g) - counts[g] for g in mapped)
        n = 0
        for u in used:
            if u > evictable_pages:
                break
            evictable_pages -= u
            n += 1
        return n

    # ------------------------------------------------------------ checks
    def logical_free_pages(self, handle) -> int:
        """Free pages in the logical sense (mapped free + every page of unmapped groups)."""
        return self.free_list.count(handle) + self.num_pages - self._mapped_usable

    def check(self, handle) -> None:
        """Raise AssertionError if a free page lies outside the mapped groups (the class invariant)."""
        groups = self.free_list.groups_with_free_pages(handle, self.group_pages)
        if not groups:
            return
        mapped = set(self.buffers.mapped_groups())
        bad = [g for g in groups if g not in mapped]
        if bad:
            raise AssertionError(f"free pages in unmapped groups {bad[:8]}")
        self.buffers.check_invariants()

    def status(self) -> dict:
        """The space's own numbers (groups, bytes, map / unmap counts and times)."""
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


def joint_free_pages(spaces: Sequence[tuple[KVSpace, int]], outside_chunks: int) -> int:
    """Pages every one of ``spaces`` can give at once, when each page taken in one is taken in all
    (a hybrid sliding-window model: every new token takes a row in its full-attention and in its
    sliding-window sub-pool), with ``outside_chunks`` chunks to map new groups from.

    ``spaces``: (space, pages in its free list now). The answer is the largest ``n`` such that the
    lowest unmapped groups each space must map to reach ``n`` free pages fit in ``outside_chunks``
    together. Counting each space's growable pages alone would promise the same chunks twice."""

    def chunks_for(n: int) -> int | None:
        total = 0
        for space, free in spaces:
            groups = space.groups_to_add(n - free)
            if groups is None:
                return None
            total += groups * space.buffers.chunks_per_group
        return total

    lo = min(free for _, free in spaces)
    hi = min(free + space.addable_pages() for space, free in spaces)
    while lo < hi:  # the largest n whose chunks fit (monotone in n)
        mid = (lo + hi + 1) // 2
        cost = chunks_for(mid)
        if cost is not None and cost <= outside_chunks:
            lo = mid
        else:
            hi = mid - 1
    return lo
