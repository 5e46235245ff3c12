"""Upstream's MLA pool (``MLATokenToKVPool``) built stock and elastic on one device, for the
pool-level tests of elastic KV on MLA (CPU in ``test/unit``, CUDA in ``test/gpu``).

Upstream's DeepSeek models do not run on this CPU (docs/models.md), but their KV pool does: the
pool is built through memx's hook on ``_create_buffers`` inside an open elastic build, tied to the
coordinator by ``pool_build.finish`` as the configurator's hook does, and driven through upstream's
own allocator and write / read methods (``set_mla_kv_buffer``, ``get_key_buffer``,
``get_value_buffer``). Allocations go through memx's allocator hook (``around_alloc``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_memx.config import MemxConfig
from sglang_memx.hooks import kv_cache as kv_hooks
from support.elastic_pool_build import elastic_build

KV_LORA_RANK, QK_ROPE = 32, 8  # the latent: 40 values per token and layer
LAYERS = 2


def mla_pool_class():
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool


def new_pool(size: int, page_size: int, dtype: torch.dtype, device: str):
    return mla_pool_class()(size=size, page_size=page_size, dtype=dtype, kv_lora_rank=KV_LORA_RANK,
                            qk_rope_head_dim=QK_ROPE, layer_num=LAYERS, device=device, enable_memory_saver=False,
                            dcp_replicated=True)  # fmt: skip


def new_allocator(pool, device: str):
    if pool.page_size == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        return TokenToKVPoolAllocator(pool.size, pool.dtype, device, pool, True)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(pool.size, pool.page_size, pool.dtype, device, pool, True)


def elastic_server(monkeypatch, config: MemxConfig, size: int, page_size: int, dtype: torch.dtype, device: str):
    """(pool, allocator, coordinator) of an MLA pool built inside an open elastic build and tied to
    its coordinator as ``KVCacheConfigurator.configure``'s hook does."""
    return elastic_build(
        monkeypatch,
        config,
        "DeepseekV2ForCausalLM",
        (mla_pool_class(), "_create_buffers"),
        lambda: new_pool(size, page_size, dtype, device),
        lambda p: new_allocator(p, device),
    )


def alloc(allocator, n: int):
    """``allocator.alloc(n)`` through memx's hook (the coordinator maps groups first)."""
    return kv_hooks.around_alloc(type(allocator).alloc, allocator, n)


def write_latents(pool, loc: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write a (nope, rope) latent of every layer at ``loc`` through upstream's MLA write path."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(LAYERS):
        nope = torch.randn(len(loc), 1, KV_LORA_RANK, generator=gen).to(pool.dtype).to(pool.device)
        rope = torch.randn(len(loc), 1, QK_ROPE, generator=gen).to(pool.dtype).to(pool.device)
        pool.set_mla_kv_buffer(SimpleNamespace(layer_id=layer), loc, nope, rope)
        written.append((nope, rope))
    return written


def read_latents(pool, loc: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K = whole latent, V = its first kv_lora_rank values) at ``loc``, as attention reads them."""
    return [(pool.get_key_buffer(layer)[loc].clone(), pool.get_value_buffer(layer)[loc].clone())
            for layer in range(LAYERS)]  # fmt: skip
