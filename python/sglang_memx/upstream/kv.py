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


# ------------------------------------------------------------------ the pools elastic KV backs
_MHA = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_MLA = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool"


def is_mla_pool(kvcache) -> bool:
    """Whether ``kvcache`` is upstream's MLA pool itself (one latent buffer per layer), not a
    subclass (FP4, DeepSeek sparse attention) whose buffers are laid out otherwise."""
    return type(kvcache) is resolve(_MLA)


def elastic_pool_refusal(kvcache) -> str | None:
    """Why elastic KV cannot back ``kvcache``'s buffers (None: it can): the plain MHA/GQA pool
    (``plain_mha_refusal``) or the plain MLA pool (``plain_mla_refusal``)."""
    if is_mla_pool(kvcache):
        return plain_mla_refusal(kvcache)
    if isinstance(kvcache, resolve(_MLA)):
        return f"{type(kvcache).__name__} (a variant of the MLA pool)"
    return plain_mha_refusal(kvcache)


def plain_mha_refusal(pool) -> str | None:
    """Why elastic KV cannot back ``pool``'s buffers (None: it can): only the plain
    MHA/GQA pool with the NHD layout (``_create_buffers_normal``'s token-row branch), whose
    buffers upstream would not place in a custom memory pool (the pool chosen in
    ``KVCache.__init__``, today Mooncake's for NVLink transfers: views over pooled groups
    would silently take the buffers out of it)."""
    if type(pool) is not resolve(_MHA):
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


def plain_mla_refusal(mla_pool) -> str | None:
    """Why elastic KV cannot back an ``MLATokenToKVPool`` (None: it can): its ``_create_buffers``
    builds one ``(size + page, 1, kv_lora_rank + qk_rope_head_dim)`` latent buffer per layer, which
    pooled groups can back row for row, unless upstream would place it in a custom memory pool,
    stores it quantized (fp8 as bytes) or shards it by layer."""
    if mla_pool.enable_custom_mem_pool:
        return "a custom memory pool for the KV buffers (upstream's Mooncake NVLink pool)"
    if mla_pool.use_dsa:
        return "DeepSeek sparse attention's MLA pool"
    if mla_pool.store_dtype != mla_pool.dtype:
        return "a quantized KV cache"
    if mla_pool.post_capture_active:
        return "post-capture KV backing"
    if mla_pool.layer_shard_enabled:
        return "a layer-sharded MLA pool"
    return None


def pool_geometry(kvcache) -> dict:
    """Rows, page size, layers, bytes per row of each buffer (``row_bytes``, in the order
    ``set_kv_views`` numbers them) and the KV cell of a pool elastic KV backs: the MHA pool
    (``kind`` "mha": K of every layer, then V; KV heads, head dims) or the MLA pool (``kind``
    "mla": one latent row per layer; its ``kv_lora_rank`` and ``qk_rope_head_dim``)."""
    if is_mla_pool(kvcache):
        return _mla_geometry(kvcache)
    return _mha_geometry(kvcache)


def _mha_geometry(pool) -> dict:
    itemsize = pool.store_dtype.itemsize
    k_row, v_row = pool.head_num * pool.head_dim * itemsize, pool.head_num * pool.v_head_dim * itemsize
    return {
        "kind": "mha",
        "rows": pool.size + pool.page_size,  # the padded page absorbs dummy writes
        "page_size": pool.page_size,
        "pages": pool.size // pool.page_size,
        "layers": pool.layer_num,
        "row_bytes": [k_row] * pool.layer_num + [v_row] * pool.layer_num,
        "k_row_bytes": k_row,
        "v_row_bytes": v_row,
        "device": pool.device,
        "kv_heads": pool.head_num,
        "head_dim": pool.head_dim,
        "v_head_dim": pool.v_head_dim,
        "dtype": pool.dtype,
        "store_dtype": pool.store_dtype,
    }


def _mla_geometry(mla_pool) -> dict:
    row = mla_pool.kv_cache_dim * mla_pool.store_dtype.itemsize
    return {
        "kind": "mla",
        "rows": mla_pool.size + mla_pool.page_size,
        "page_size": mla_pool.page_size,
        "pages": mla_pool.size // mla_pool.page_size,
        "layers": mla_pool.layer_num,
        "row_bytes": [row] * mla_pool.layer_num,
        "latent_dim": mla_pool.kv_cache_dim,
        "kv_lora_rank": mla_pool.kv_lora_rank,
        "qk_rope_head_dim": mla_pool.qk_rope_head_dim,
        "device": mla_pool.device,
        "dtype": mla_pool.dtype,
        "store_dtype": mla_pool.store_dtype,
    }


def set_kv_views(kvcache, views_of) -> None:
    """Give the pool its buffers from ``views_of(buffer_index, dtype, row_shape)``, as its own
    buffer build would have: for the MHA pool 0..L-1 are K of each layer and L..2L-1 V; for the
    MLA pool 0..L-1 are each layer's latent rows."""
    if is_mla_pool(kvcache):
        _set_mla_views(kvcache, views_of)
    else:
        _set_mha_views(kvcache, views_of)


def _set_mha_views(pool, views_of) -> None:
    layers = pool.layer_num
    pool.k_buffer = [views_of(i, pool.store_dtype, (pool.head_num, pool.head_dim)) for i in range(layers)]
    pool.v_buffer = [views_of(layers + i, pool.store_dtype, (pool.head_num, pool.v_head_dim)) for i in range(layers)]


def _set_mla_views(mla_pool, views_of) -> None:
    mla_pool.kv_buffer = [views_of(i, mla_pool.store_dtype, (1, mla_pool.kv_cache_dim))
                          for i in range(mla_pool.layer_num)]  # fmt: skip


def kv_buffers(allocator) -> list:
    """Every buffer of the allocator's pool, in ``set_kv_views``' order (MHA: K then V; MLA: latents)."""
    kvcache = allocator.get_kvcache()
    if is_mla_pool(kvcache):
        return _mla_buffers(kvcache)
    return _mha_buffers(kvcache)


def _mha_buffers(pool) -> list:
    return list(pool.k_buffer) + list(pool.v_buffer)


def _mla_buffers(mla_pool) -> list:
    return list(mla_pool.kv_buffer)


def pool_description(allocator) -> dict:
    """Kind, dtypes, device, layers and exact buffer bytes of the allocator's pool."""
    kvcache = allocator.get_kvcache()
    if isinstance(kvcache, resolve(_MHA)):
        k_bytes, v_bytes = _mha_size_bytes(kvcache)
        nbytes = int(k_bytes + v_bytes)
    elif is_mla_pool(kvcache):
        nbytes = _mla_size_bytes(kvcache)
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


def _mha_size_bytes(pool) -> tuple[int, int]:
    return pool.get_kv_size_bytes()


def _mla_size_bytes(mla_pool) -> int:
    return int(mla_pool.get_kv_size_bytes())


# ------------------------------------------------------------------ a hybrid sliding-window model's pools
_SWA_ALLOCATOR = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
_SWA_POOL = "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool"


def is_swa_allocator(allocator) -> bool:
    """Whether ``allocator`` is upstream's hybrid sliding-window allocator itself (two sub-allocators,
    a full-attention and a sliding-window one), not its pure-SWA or unified subclasses."""
    return type(allocator) is resolve(_SWA_ALLOCATOR)


def swa_sub_allocators(swa_allocator) -> tuple:
    """(full-attention, sliding-window) sub-allocators of a hybrid sliding-window allocator."""
    return swa_allocator.full_attn_allocator, swa_allocator.swa_attn_allocator


def swa_ring(swa_allocator) -> bool:
    """Whether the hybrid allocator keeps each request's sliding-window rows in a ring of its own
    (addressed by request slot, not handed out by the sliding-window sub-allocator)."""
    return bool(swa_allocator.swa_req_ring)


def swa_sub_pools(swa_pool) -> tuple:
    """(full-attention, sliding-window) sub-pools of upstream's ``SWAKVPool``."""
    return swa_pool.full_kv_pool, swa_pool.swa_kv_pool


def is_swa_pool(kvcache) -> bool:
    return type(kvcache) is resolve(_SWA_POOL)


def _own(allocator):
    """The allocator whose free list a server's main KV space keeps: a hybrid sliding-window
    model's full-attention sub-allocator (its sliding-window space keeps the other one, handed
    to it as is), else the allocator itself."""
    return swa_sub_allocators(allocator)[0] if is_swa_allocator(allocator) else allocator


# ------------------------------------------------------------------ the allocators' free lists
def page_size(allocator) -> int:
    return allocator.page_size


def free_pages(allocator) -> torch.Tensor:
    return _own(allocator).free_pages


def set_free_pages(allocator, pages: torch.Tensor) -> None:
    _own(allocator).free_pages = pages


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
    allocator = _own(allocator)
    allocator.release_pages = torch.empty((0,), dtype=torch.int64, device=device)
    if _paged(allocator):
        _clear_paged_staging(allocator)


def free_page_count(allocator) -> int:
    """Pages in the free list plus pages staged by ``free`` and not merged yet (either
    allocator's staging: before, the paged allocator's staged frees were not counted, so memx
    mapped groups a free list about to be merged did not need)."""
    allocator = _own(allocator)
    staged = _paged_staged_count(allocator) if _paged(allocator) else len(allocator.release_pages)
    return len(allocator.free_pages) + staged


def merge_staged_frees(allocator) -> None:
    _own(allocator).merge_and_sort_free()


def all_free_pages(allocator):
    return _own(allocator).get_all_free_pages()


def available_tokens(allocator) -> int:
    return int(allocator.available_size())


def alloc_tokens(allocator, n: int):
    return allocator.alloc(n)


def free_tokens(allocator, idx) -> None:
    allocator.free(idx)
