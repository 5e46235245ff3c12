"""The KV pool and its token allocators (``sglang.srt.mem_cache``), as memx reads and edits them.

Upstream names only through here (see ``manifest``). memx state hangs on the allocator
(``attach_memx`` / ``memx_of``): the one way the coordinator (``coordinator.device.of``) is found.
"""

from __future__ import annotations

import torch

from sglang_memx.upstream.manifest import resolve

MEMX_ATTR = "_memx_coordinator"


# ------------------------------------------------------------------ memx state on the allocator
def attach_memx(allocator, coordinator) -> None:
    setattr(allocator, MEMX_ATTR, coordinator)


def memx_of(allocator):
    """The coordinator tied to this allocator, or None (stock KV). Our attribute, not upstream's."""
    return vars(allocator).get(MEMX_ATTR) if allocator is not None else None


# ------------------------------------------------------------------ the configurator's pool build
def configurator_parts(configurator):
    """(server_args, model_config, model_dtype, is_draft_worker) of a KVCacheConfigurator."""
    return configurator.server_args, configurator.model_config, configurator.model_dtype, configurator.is_draft_worker


def configurator_pool_traits(configurator) -> dict:
    """What the configurator resolved about the pool it is about to build: a hybrid sliding-window
    model (``SWAKVPool``), MLA, a hybrid linear-attention (mamba-like) model."""
    return {
        "hybrid_swa": bool(configurator.is_hybrid_swa),
        "mla": bool(configurator.use_mla_backend),
        "linear": configurator.mambaish_config is not None,
    }


def configured_pool_and_allocator(config_result):
    """The KV pool and token allocator a KVCacheConfigurator.configure built."""
    return config_result.token_to_kv_pool, config_result.token_to_kv_pool_allocator


# ------------------------------------------------------------------ the MHA pool
def plain_mha_refusal(pool) -> str | None:
    """Why elastic KV cannot back ``pool``'s buffers (None: it can): only the plain
    MHA/GQA pool with the NHD layout (``_create_buffers_normal``'s token-row branch), whose
    buffers upstream would not place in a custom memory pool (the pool chosen in
    ``KVCache.__init__``, today Mooncake's for NVLink transfers: views over pooled groups
    would silently take the buffers out of it)."""
    if type(pool) is not resolve("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"):
        return f"{type(pool).__name__} (a variant of the MHA pool)"
    if pool.enable_custom_mem_pool:
        return "a custom memory pool for the KV buffers (upstream's Mooncake NVLink pool)"
    if pool.is_quantized_kv_cache:
        return "a quantized KV cache"
    if pool.post_capture_active:
        return "post-capture KV backing"
    if pool.kv_cache_layout != "nhd":
        return f"the {pool.kv_cache_layout!r} KV layout"
    return None


def pool_geometry(pool) -> dict:
    """Rows, bytes per row and layers of an MHA pool's K and V buffers, and its KV cell
    (KV heads, head dims, the KV dtype and the dtype rows are stored in)."""
    itemsize = pool.store_dtype.itemsize
    return {
        "rows": pool.size + pool.page_size,  # the padded page absorbs dummy writes
        "page_size": pool.page_size,
        "pages": pool.size // pool.page_size,
        "layers": pool.layer_num,
        "k_row_bytes": pool.head_num * pool.head_dim * itemsize,
        "v_row_bytes": pool.head_num * pool.v_head_dim * itemsize,
        "device": pool.device,
        "kv_heads": pool.head_num,
        "head_dim": pool.head_dim,
        "v_head_dim": pool.v_head_dim,
        "dtype": pool.dtype,
        "store_dtype": pool.store_dtype,
    }


def set_kv_views(pool, views_of) -> None:
    """Give the pool K/V buffers from ``views_of(buffer_index, dtype, row_shape)``
    (0..L-1: K of each layer, L..2L-1: V), as ``_create_buffers_normal`` would have."""
    layers = pool.layer_num
    pool.k_buffer = [views_of(i, pool.store_dtype, (pool.head_num, pool.head_dim)) for i in range(layers)]
    pool.v_buffer = [views_of(layers + i, pool.store_dtype, (pool.head_num, pool.v_head_dim)) for i in range(layers)]


def kv_buffers(allocator) -> list:
    """Every K then V buffer of the allocator's MHA pool."""
    pool = allocator.get_kvcache()
    return list(pool.k_buffer) + list(pool.v_buffer)


def pool_description(allocator) -> dict:
    """Kind, dtypes, device, layers and exact buffer bytes of the allocator's pool."""
    kvcache = allocator.get_kvcache()
    if isinstance(kvcache, resolve("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool")):
        pool = kvcache
        k_bytes, v_bytes = pool.get_kv_size_bytes()
        nbytes = int(k_bytes + v_bytes)
    else:  # other pool kinds: upstream's own GB figure
        nbytes = int(round(float(kvcache.mem_usage) * (1 << 30)))
    return {
        "kind": type(kvcache).__name__,
        "dtype": kvcache.dtype,
        "store_dtype": kvcache.store_dtype,
        "device": str(kvcache.device),
        "layers": kvcache.layer_num,
        "bytes": nbytes,
    }


# ------------------------------------------------------------------ the allocators' free lists
def page_size(allocator) -> int:
    return allocator.page_size


def free_pages(allocator) -> torch.Tensor:
    return allocator.free_pages


def set_free_pages(allocator, pages: torch.Tensor) -> None:
    allocator.free_pages = pages


_PAGED = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"


def _paged(allocator) -> bool:
    """The paged allocator stages its frees in a list of its own (``staged_pages``, counted in
    ``num_staged_pages``), not in the base class's ``release_pages``."""
    return isinstance(allocator, resolve(_PAGED))


def _clear_paged_staging(paged_allocator) -> None:
    paged_allocator.staged_pages = []
    paged_allocator.num_staged_pages = 0


def _paged_staged_count(paged_allocator) -> int:
    return paged_allocator.num_staged_pages


def clear_staged_frees(allocator, device) -> None:
    """Empty the staged frees after the free list was rebuilt."""
    allocator.release_pages = torch.empty((0,), dtype=torch.int64, device=device)
    if _paged(allocator):
        _clear_paged_staging(allocator)


def free_page_count(allocator) -> int:
    """Pages in the free list plus pages staged by ``free`` and not merged yet (either
    allocator's staging: before, the paged allocator's staged frees were not counted, so memx
    mapped groups a free list about to be merged did not need)."""
    staged = _paged_staged_count(allocator) if _paged(allocator) else len(allocator.release_pages)
    return len(allocator.free_pages) + staged


def merge_staged_frees(allocator) -> None:
    allocator.merge_and_sort_free()


def all_free_pages(allocator):
    return allocator.get_all_free_pages()


def available_tokens(allocator) -> int:
    return int(allocator.available_size())


def alloc_tokens(allocator, n: int):
    return allocator.alloc(n)


def free_tokens(allocator, idx) -> None:
    allocator.free(idx)
