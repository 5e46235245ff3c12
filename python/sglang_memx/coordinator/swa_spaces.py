"""A hybrid sliding-window model's two KV spaces on one pool (issue 28; docs/models.md).

Upstream serves such a model (Mellum, GPT-OSS) from ``SWAKVPool``: a full-attention and a
sliding-window sub-pool, each an ``MHATokenToKVPool`` of its own size, behind
``SWATokenToKVPoolAllocator``, whose two sub-allocators hand out a row in each for every new token
(a full-attention slot maps to a sliding-window slot). memx backs both sub-pools with elastic KV on
the server's one pool: the coordinator's own space keeps the full-attention sub-allocator's free
list, a second ``ElasticKV`` the sliding-window one's. Every chunk either space does not hold can go
to the other: the window's rows, freed as tokens leave it, are memory the full-attention layers can
use and back.

``SwaSpaces`` is the component both coordinators of such a server carry (the server's, tied to the
hybrid allocator and its full-attention sub-allocator, and the sliding-window space's own, tied to
the other sub-allocator so that its allocations map its groups):

* the sliding-window space's deflation and premap, in the server's tick (its own coordinator never
  ticks);
* the available size each sub-allocator reports: the pages both spaces can give *at once*
  (``memory_ext.pool.kv_space.joint_free_pages``), so upstream's admission, which asks both, is
  never promised the same chunks twice;
* the leak check's view (``logical``): each space's free pages plus its unmapped ones, as for one
  space (``after_get_token_info``);
* the request-length cap: the longest request both spaces can back within the budget.

Invariant: the two spaces share one ``ChunkPool`` (an own pool; a shared pool is refused for this
pool kind, ``families``), and neither space's growth is counted against the other's free list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memory_ext.pool.kv_space import joint_free_pages
from sglang_memx.coordinator.parts import Iteration, Source, Step, step
from sglang_memx.elastic import iteration
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv


@dataclass(eq=False)
class SwaSpaces:
    """The full-attention space (the server coordinator's ``kv``) and the sliding-window space, with
    the sub-allocator whose free list each keeps."""

    full: ElasticKV
    swa: ElasticKV
    full_allocator: object
    swa_allocator: object
    name: str = "sliding-window space"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("deflate the sliding-window space",
                 lambda it: iteration.deflate(self.swa, self.swa_allocator, it.busy)),
            step("premap the sliding-window space", self._premap),
        )  # fmt: skip

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"sliding_window_space": self.swa.status()}

    def _premap(self, it: Iteration) -> None:
        if it.busy:
            iteration.premap(self.swa, self.swa_allocator, it.scheduler, 0)

    # ------------------------------------------------------------ what upstream reads
    def available_tokens(self, allocator, upstream_free_tokens: int) -> int:
        """``allocator``'s available size: its free tokens, raised to the tokens both spaces can
        give at once when mapping groups gives more."""
        pages = joint_free_pages(
            [(self.full, up_kv.free_page_count(self.full_allocator)),
             (self.swa, up_kv.free_page_count(self.swa_allocator))],
            self.full.buffers.pool.available(),
        )  # fmt: skip
        mine = up_kv.free_page_count(allocator)
        return upstream_free_tokens + max(0, pages - mine) * up_kv.page_size(allocator)

    def logical(self, capacities) -> tuple:
        """Upstream's ``((full capacity, available), (sliding capacity, available))`` with each
        space's logical free tokens (free pages and unmapped ones), which its leak check adds up."""
        (full_cap, _), (swa_cap, _) = capacities
        page = up_kv.page_size(self.full_allocator)
        return ((full_cap, self.full.logical_free_pages(self.full_allocator) * page),
                (swa_cap, self.swa.logical_free_pages(self.swa_allocator) * page))  # fmt: skip

    def physical_max_tokens(self, budget_chunks: int, kept_chunks: int) -> int:
        """The longest request both spaces can back within the budget (every token a row in each)."""
        left = max(0, budget_chunks - kept_chunks)
        full, swa = self.full.buffers, self.swa.buffers
        best = 0
        for groups in range(1, self.full.num_groups + 1):
            tokens = groups * full.group_rows
            swa_groups = -(-tokens // swa.group_rows)
            chunks = groups * full.chunks_per_group + swa_groups * swa.chunks_per_group
            if swa_groups > self.swa.num_groups or chunks > left:
                break
            best = tokens
        return max(0, best - self.full.page_size)  # page 0 is never allocatable
