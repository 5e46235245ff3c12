"""Elastic KV on upstream's SWAKVPool (issue 28): both sub-pools backed, two spaces on one pool
(``coordinator.swa_spaces``), at the pool level on CPU with upstream's own pool and hybrid allocator.

memx refuses this pool on the CPU at launch (upstream's CPU attention reads the sliding-window
sub-pool at full-pool slots; stock itself fails under memory pressure, docs/models.md); the serving
path is a GPU one, ``test/gpu/test_swa_elastic_cuda.py`` (written, not run on a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.swa_memory_pool")

from memory_ext.pool.kv_space import joint_free_pages  # noqa: E402
from sglang_memx.config import MemxConfig  # noqa: E402
from sglang_memx.coordinator.parts import Iteration  # noqa: E402
from sglang_memx.coordinator.swa_spaces import SwaSpaces  # noqa: E402
from sglang_memx.upstream import kv as up_kv  # noqa: E402
from support import swa_elastic as swa  # noqa: E402

SIZE, SIZE_SWA = 1024, 819  # upstream's split at --swa-full-tokens-ratio 0.8


@pytest.fixture(autouse=True)
def _close_pools():
    """Every pool a test built is unmapped and its chunks destroyed (they are file descriptors)."""
    yield
    from support.elastic_pool_build import close_built

    close_built()


CHUNK_KB = 4  # a group: 32 tokens, 2 chunks (K and V of the sub-pool's one layer, 128 B a row)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_both_sub_pools_map_as_they_fill_and_read_what_stock_reads(monkeypatch):
    pool, allocator, coordinator = swa.elastic_server(monkeypatch, MemxConfig(elastic_kv=True, chunk_kb=CHUNK_KB),
                                                      SIZE, SIZE_SWA, torch.float32, "cpu")  # fmt: skip
    stock = swa.new_pool(SIZE, SIZE_SWA, torch.float32, "cpu")
    stock_allocator = swa.new_allocator(stock, "cpu")
    pair = coordinator.part(SwaSpaces)
    full_alloc, swa_alloc = up_kv.swa_sub_allocators(allocator)
    assert pair is not None and (pair.full_allocator, pair.swa_allocator) == (full_alloc, swa_alloc)
    assert pair.full is coordinator.kv and pair.swa.buffers.pool is coordinator.kv.buffers.pool  # one pool
    assert (coordinator.kv.buffers.num_mapped, pair.swa.buffers.num_mapped) == (1, 1)
    # no budget: the own pool holds both sub-pools' logical size, so upstream sees stock's capacity
    assert allocator.available_size() == stock_allocator.available_size() == SIZE_SWA
    loc, stock_loc = allocator.alloc(100), stock_allocator.alloc(100)
    written = swa.write(pool, allocator, loc, seed=3)
    swa.write(stock, stock_allocator, stock_loc, seed=3)
    assert _equal(swa.read(pool, allocator, loc), written) and _equal(swa.read(stock, stock_allocator, stock_loc),
                                                                      written)  # fmt: skip
    assert coordinator.kv.buffers.num_mapped == pair.swa.buffers.num_mapped == 4  # 100 tokens: groups 0-3 each
    # the leak check's view: every token is available, held or cached, in each sub-pool
    (full_cap, full_free), (swa_cap, swa_free) = allocator.swa_capacity_and_available(
        full_capacity=SIZE, swa_capacity=SIZE_SWA
    )
    assert (full_cap - full_free, swa_cap - swa_free) == (100, 100)
    allocator.free(loc)
    # the server's tick deflates both spaces (the sliding-window one by its component's step)
    steps = [s.name for _, s in coordinator.iteration_order()]
    assert steps.index("deflate") < steps.index("deflate the sliding-window space") < steps.index("premap")
    it = Iteration(scheduler=None, allocator=allocator, kv=coordinator.kv, tree=None, coordinator=coordinator)
    for _, s in coordinator.iteration_order():
        if s.name in ("deflate", "deflate the sliding-window space"):
            s.run(it)  # idle: no spare groups kept
    assert (coordinator.kv.buffers.num_mapped, pair.swa.buffers.num_mapped) == (1, 1)
    assert allocator.swa_capacity_and_available(full_capacity=SIZE, swa_capacity=SIZE_SWA) == (
        (SIZE, SIZE),
        (SIZE_SWA, SIZE_SWA),
    )
    coordinator.kv.check(full_alloc)
    pair.swa.check(swa_alloc)


def test_a_budget_is_shared_by_both_sub_pools_and_never_promised_twice(monkeypatch):
    """12 chunks: group 0 of each space holds 4, so 8 are left, two more groups in each space: 31 + 64 tokens
    at once. Counting each space's growable pages alone would have promised 31 + 4 x 32 in each."""
    config = MemxConfig(elastic_kv=True, chunk_kb=CHUNK_KB, pool_budget_gb=12 * CHUNK_KB / (1 << 20))
    pool, allocator, coordinator = swa.elastic_server(monkeypatch, config, SIZE, SIZE_SWA, torch.float32, "cpu")
    pair = coordinator.part(SwaSpaces)
    assert coordinator.kv.growable_pages() == 4 * 32  # what one space alone would have counted
    assert allocator.available_size() == 31 + 64 == pair.physical_max_tokens(12, 0)
    loc = allocator.alloc(95)
    assert loc is not None and allocator.available_size() == 0
    assert allocator.alloc(1) is None  # upstream's own refusal: no crash, nothing half-allocated
    written = swa.write(pool, allocator, loc, seed=5)
    assert _equal(swa.read(pool, allocator, loc), written)
    allocator.free(loc[:40])  # the window's rows and the full rows come back in both
    assert allocator.available_size() == 40


def test_joint_free_pages_counts_each_spaces_groups_once_from_one_pool():
    class Space:  # what joint_free_pages reads of a KVSpace: full-size groups of ``pages``, ``left`` of them
        def __init__(self, pages, left, cpg):
            self.pages, self.left = pages, left
            self.buffers = type("B", (), {"chunks_per_group": cpg})()

        def groups_to_add(self, n):
            k = max(0, -(-n // self.pages))
            return k if k <= self.left else None

        def addable_pages(self):
            return self.pages * self.left

    full, window = Space(32, 3, 2), Space(16, 2, 1)
    assert joint_free_pages([(full, 10), (window, 40)], 0) == 10  # nothing to map: the smaller free list
    assert joint_free_pages([(full, 10), (window, 40)], 2) == 40  # one full group (2 chunks); the window has 40
    assert joint_free_pages([(full, 10), (window, 40)], 3) == 42  # and one window group: 32 more in full
    assert joint_free_pages([(full, 10), (window, 40)], 100) == 72  # the window space's whole size


@pytest.mark.parametrize(
    "mapped,pages,want",
    [
        ((0,), 0, 0),
        ((0,), 1, 1),
        ((0,), 33, 2),
        ((0, 1), 32, 1),
        ((0,), 31 * 32, None),
        ((0, 5), 29 * 32 + 8, 30),
        ((0, 5), 29 * 32 + 10, None),
    ],
)
def test_groups_to_add_counts_the_lowest_unmapped_groups_and_the_partial_last(mapped, pages, want):
    from memory_ext.pool import ChunkPool, LayeredKVBuffers
    from memory_ext.vmm import host_backend
    from sglang_memx.elastic.kv import ElasticKV

    buffers = LayeredKVBuffers(ChunkPool(host_backend(4096), 100), [128, 128], 1000 + 1, 1)  # 32 groups
    kv = ElasticKV(buffers, 1, 1000)  # the last group (31) holds 1000 - 31 * 32 + 1 = 9 pages
    buffers.map_groups([g for g in mapped if g])
    try:
        assert kv.groups_to_add(pages) == want
    finally:
        buffers.close()
        buffers.pool.trim()


def test_a_per_request_sliding_window_ring_is_refused_naming_the_flag(monkeypatch):
    """In ring mode upstream addresses the sliding-window rows by request slot, outside the sub-allocator
    whose free list memx keeps inside mapped groups: backing them would fault, so the build refuses."""
    from sglang_memx.config import MemxConfigError
    from sglang_memx.coordinator import pool_build

    monkeypatch.setattr(pool_build.up_kv, "swa_ring", lambda allocator: True)
    with pytest.raises(MemxConfigError, match="per-request sliding-window ring") as info:
        swa.elastic_server(monkeypatch, MemxConfig(elastic_kv=True, chunk_kb=CHUNK_KB), SIZE, SIZE_SWA,
                           torch.float32, "cpu")  # fmt: skip
    assert info.value.flag == "--memx-elastic-kv"
