"""Elastic KV on upstream's MLA pool on a GPU (issue 28): the CPU scenario of
``test/unit/test_mla_elastic_pool.py`` with the CUDA VMM backend, bf16 latents and upstream's
Triton MLA write kernel. Written, not run on a GPU."""

from __future__ import annotations

import pytest
import torch

from sglang_memx.config import MemxConfig
from sglang_memx.hooks import kv_cache as kv_hooks

pytestmark = pytest.mark.gpu

SIZE = 1 << 16


@pytest.fixture(autouse=True)
def _close_pools():
    """Every pool a test built is unmapped and its chunks destroyed (they are file descriptors)."""
    yield
    from support.elastic_pool_build import close_built

    close_built()


@pytest.mark.parametrize("page_size", [1, 64])
def test_an_elastic_mla_pool_on_a_gpu_maps_as_it_fills_and_reads_what_stock_reads(monkeypatch, page_size):
    from support import mla_elastic as mla

    config = MemxConfig(elastic_kv=True)
    pool, allocator, coordinator = mla.elastic_server(monkeypatch, config, SIZE, page_size, torch.bfloat16, "cuda")
    stock = mla.new_pool(SIZE, page_size, torch.bfloat16, "cuda")
    stock_allocator = mla.new_allocator(stock, "cuda")
    kv = coordinator.kv
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
    assert kv_hooks.after_available_size(allocator.available_size(), allocator) == stock_allocator.available_size()
    start = kv.buffers.num_mapped
    n = (2 * kv.buffers.group_rows // page_size + 1) * page_size
    loc, stock_loc = mla.alloc(allocator, n), stock_allocator.alloc(n)
    mla.write_latents(pool, loc, seed=1)
    mla.write_latents(stock, stock_loc, seed=1)
    torch.cuda.synchronize()
    for (k, v), (sk, sv) in zip(mla.read_latents(pool, loc), mla.read_latents(stock, stock_loc)):
        assert torch.equal(k, sk) and torch.equal(v, sv)
    assert start < kv.buffers.num_mapped < kv.num_groups
    allocator.free(loc)
    assert kv.shrink(allocator) > 0
    kv.check(allocator)
