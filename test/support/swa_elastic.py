"""Upstream's hybrid sliding-window pool (``SWAKVPool``: a full-attention and a sliding-window
``MHATokenToKVPool``) and its allocator, built stock and elastic on one device, for the pool-level
tests of elastic KV on it (CPU in ``test/unit``, CUDA in ``test/gpu``).

Upstream's CPU attention cannot serve this pool (it reads the sliding-window sub-pool at full-pool
slots; docs/models.md), so memx refuses it on the CPU at launch; the pool and allocator themselves
run here. The pool is built through memx's buffer hook inside an open elastic build, tied by
``pool_build.finish`` as the configurator's hook ties it, and upstream's allocator methods run with
memx's hooks around them as upstream's registry applies them (``hooked_allocators``). Writes and
reads go through upstream's ``set_kv_buffer`` / ``get_key_buffer`` with the sliding-window layer at
its translated slots, as the GPU backends address it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_memx.config import MemxConfig
from sglang_memx.hooks import kv_cache as kv_hooks
from support.elastic_pool_build import elastic_build

HEADS, HEAD_DIM = 2, 16
SWA_LAYER, FULL_LAYER = 0, 1


def new_pool(size: int, size_swa: int, dtype: torch.dtype, device: str):
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=size, size_swa=size_swa, page_size=1, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
                     swa_attention_layer_ids=[SWA_LAYER], full_attention_layer_ids=[FULL_LAYER], device=device,
                     enable_memory_saver=False)  # fmt: skip


def new_allocator(pool, device: str):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(pool.size, pool.size_swa, 1, pool.dtype, device, pool, True)


def hooked_allocators(monkeypatch) -> None:
    """memx's hooks on the token allocator and the hybrid allocator's statistics, as upstream applies them."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    alloc, available, clear = (TokenToKVPoolAllocator.alloc, TokenToKVPoolAllocator.available_size,
                               TokenToKVPoolAllocator.clear)  # fmt: skip
    stats = SWATokenToKVPoolAllocator.swa_capacity_and_available
    monkeypatch.setattr(TokenToKVPoolAllocator, "alloc", lambda a, n: kv_hooks.around_alloc(alloc, a, n))
    monkeypatch.setattr(TokenToKVPoolAllocator, "available_size",
                        lambda a: kv_hooks.after_available_size(available(a), a))  # fmt: skip
    monkeypatch.setattr(TokenToKVPoolAllocator, "clear", lambda a: kv_hooks.after_clear(clear(a), a))
    monkeypatch.setattr(SWATokenToKVPoolAllocator, "swa_capacity_and_available",
                        lambda a, **kw: kv_hooks.after_swa_capacity_and_available(stats(a, **kw), a, **kw))  # fmt: skip


def elastic_server(monkeypatch, config: MemxConfig, size: int, size_swa: int, dtype: torch.dtype, device: str):
    """(pool, allocator, coordinator) of an SWAKVPool built inside an open elastic build of a hybrid
    sliding-window model, its allocator's hooks in place, tied as ``KVCacheConfigurator.configure``'s hook ties it."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    hooked_allocators(monkeypatch)
    return elastic_build(monkeypatch, config, "MellumForCausalLM", (MHATokenToKVPool, "_create_buffers_normal"),
                         lambda: new_pool(size, size_swa, dtype, device), lambda p: new_allocator(p, device),
                         hybrid_swa=True)  # fmt: skip


def write(pool, allocator, loc: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """K and V of both layers at ``loc`` (the sliding-window layer at its translated slots); returns them."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    gen = torch.Generator().manual_seed(seed)
    swa = allocator.translate_loc_from_full_to_swa(loc)
    written = []
    for layer in (SWA_LAYER, FULL_LAYER):
        k, v = (torch.randn(len(loc), HEADS, HEAD_DIM, generator=gen).to(pool.dtype).to(pool.device) for _ in "kv")
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, swa), k, v)
        written += [k, v]
    return written


def read(pool, allocator, loc: torch.Tensor) -> list[torch.Tensor]:
    swa = allocator.translate_loc_from_full_to_swa(loc)
    out = []
    for layer, rows in ((SWA_LAYER, swa), (FULL_LAYER, loc)):
        out += [pool.get_key_buffer(layer)[rows].clone(), pool.get_value_buffer(layer)[rows].clone()]
    return out
