"""Elastic KV on upstream's SWAKVPool on a GPU (issue 28): the CPU scenario of
``test/unit/test_swa_elastic_pool.py`` with the CUDA VMM backend and bf16 rows, both sub-pools as two
spaces on one pool under a shared budget. On a GPU the attention backends address the sliding-window
layer at its translated slots, which is why memx serves this pool there and refuses it on the CPU.
Written, not run on a GPU."""

from __future__ import annotations

import pytest
import torch

from sglang_memx.config import MemxConfig
from sglang_memx.coordinator.swa_spaces import SwaSpaces

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _close_pools():
    """Every pool a test built is unmapped and its chunks destroyed (they are file descriptors)."""
    yield
    from support.elastic_pool_build import close_built

    close_built()


def test_both_sub_pools_of_an_swa_pool_on_a_gpu_share_one_budget(monkeypatch):
    from support import swa_elastic as swa

    stock = swa.new_pool(1 << 16, 52428, torch.bfloat16, "cuda")
    stock_allocator = swa.new_allocator(stock, "cuda")
    pool, allocator, coordinator = swa.elastic_server(monkeypatch, MemxConfig(elastic_kv=True), 1 << 16, 52428,
                                                      torch.bfloat16, "cuda")  # fmt: skip
    pair = coordinator.part(SwaSpaces)
    assert pair.swa.buffers.pool is coordinator.kv.buffers.pool
    assert allocator.available_size() == stock_allocator.available_size()
    n = 3 * coordinator.kv.buffers.group_rows
    loc, stock_loc = allocator.alloc(n), stock_allocator.alloc(n)
    written = swa.write(pool, allocator, loc, seed=1)
    swa.write(stock, stock_allocator, stock_loc, seed=1)
    torch.cuda.synchronize()
    got, want = swa.read(pool, allocator, loc), swa.read(stock, stock_allocator, stock_loc)
    assert all(torch.equal(a, b) and torch.equal(a, w) for a, b, w in zip(got, want, written))
    assert 1 < coordinator.kv.buffers.num_mapped < coordinator.kv.num_groups
    allocator.free(loc)
    assert (
        coordinator.kv.shrink(allocator, spare_groups=0) > 0 and pair.swa.shrink(pair.swa_allocator, spare_groups=0) > 0
    )
