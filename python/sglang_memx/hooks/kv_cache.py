"""Upstream subsystem: KV cache (``sglang.srt.mem_cache``): elastic KV (``--memx-elastic-kv``).

* ``KVCacheConfigurator.configure`` (around): marks the pool build as elastic
  for this process, then checks that the pool and allocator it produced are
  kinds elastic KV supports (else a clear error naming the flag) and ties the
  allocator to the controller.
* ``MHATokenToKVPool._create_buffers`` (around): for the plain MHA/GQA pool
  (unquantized, NHD), K/V buffers become views over ``LayeredKVBuffers``
  instead of zero-filled tensors; the upstream descriptor and pointer tables
  are then built from those views as usual.
* ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``: ``clear``
  (after) keeps only mapped pages in the free list; ``available_size`` (after)
  adds the pages the pool could map now; ``alloc`` / ``alloc_extend`` /
  ``alloc_decode`` (around) map groups first when the free list is short
  (see ``sglang_memx.elastic.kv`` for the invariant).
* ``BaseTokenToKVPoolAllocator.check_decode_capacity`` (around): first the
  decode step's activation is reserved (``elastic.driver.reserve_activation``;
  if it cannot fit, the step does not fit and upstream retracts); with a
  shared pool, it then borrows what the arbiter has free; if upstream still
  finds the step short, borrows again letting the arbiter reclaim from idle
  peers, before upstream retracts.
"""

from __future__ import annotations

import threading

from sglang_memx.config import MemxConfigError
from sglang_memx.hooks import HookSpec
from sglang_memx.runtime import config_of

_build = threading.local()
SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


def _elastic_of(allocator):
    return getattr(getattr(allocator, "_kvcache", None), "_memx_elastic", None)


# ------------------------------------------------------------------ pool build
def around_configure(original, configurator, *args, **kwargs):
    config = config_of(getattr(configurator, "server_args", None))
    if config.disabled or not config.elastic_kv:
        return original(configurator, *args, **kwargs)
    from sglang_memx.elastic.setup import activation_profile, max_batch_tokens

    _build.config = config
    sa = configurator.server_args
    _build.profile = activation_profile(
        getattr(configurator, "model_config", None), getattr(configurator, "model_dtype", None)
    )
    _build.batch_tokens = max_batch_tokens(sa)
    _build.server_url = f"http://{getattr(sa, 'host', '127.0.0.1')}:{getattr(sa, 'port', 0)}"
    try:
        result = original(configurator, *args, **kwargs)
    finally:
        _build.config = _build.profile = None
    pool, allocator = result.token_to_kv_pool, result.token_to_kv_pool_allocator
    kv = getattr(pool, "_memx_elastic", None)
    if kv is None:
        raise MemxConfigError(
            "--memx-elastic-kv",
            "supports the MHA/GQA token-to-KV pool only (MHATokenToKVPool, "
            f"unquantized KV, NHD layout); this model/configuration uses {type(pool).__name__}",
        )
    if type(allocator).__name__ not in SUPPORTED_ALLOCATORS:
        raise MemxConfigError(
            "--memx-elastic-kv",
            f"supports the {' and '.join(SUPPORTED_ALLOCATORS)} only; this "
            f"configuration uses {type(allocator).__name__}",
        )
    allocator._memx_elastic = kv
    kv.restrict_free_list(allocator)
    if config.host_buffer_gb is not None:  # also for servers built without the CLI parser
        config.check_server_args(bool(getattr(sa, "disable_radix_cache", False)))
        from sglang_memx.elastic.host_buffer import build_host_buffer

        kv.host = build_host_buffer(config, kv.buffers.group_bytes)
    return result


def _refusal(pool) -> str | None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
        return f"{type(pool).__name__} (a variant of the MHA pool)"
    if pool.is_quantized_kv_cache:
        return "a quantized KV cache"
    if getattr(pool, "post_capture_active", False):
        return "post-capture KV backing"
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return f"the {pool.kv_cache_layout!r} KV layout"
    return None


def around_create_buffers(original, pool, *args, **kwargs):
    config = getattr(_build, "config", None)
    if config is None:
        return original(pool, *args, **kwargs)
    why = _refusal(pool)
    if why is not None:
        raise MemxConfigError("--memx-elastic-kv", f"does not support {why}; run without the flag")
    from sglang_memx.elastic.setup import build_elastic_kv

    itemsize = pool.store_dtype.itemsize
    rows = pool.size + pool.page_size
    k_row = pool.head_num * pool.head_dim * itemsize
    v_row = pool.head_num * pool.v_head_dim * itemsize
    layers = pool.layer_num
    kv = build_elastic_kv(
        config,
        [k_row] * layers + [v_row] * layers,
        rows,
        pool.page_size,
        pool.size // pool.page_size,
        pool.device,
        server_url=getattr(_build, "server_url", None),
        profile=getattr(_build, "profile", None),
        batch_tokens=getattr(_build, "batch_tokens", 0),
    )
    for name in (
        "k_scale_buffer",
        "v_scale_buffer",
        "native_k_scale_buffer",
        "native_v_scale_buffer",
        "dq_k_buffer",
        "dq_v_buffer",
    ):
        setattr(pool, name, None)
    pool.k_buffer = [kv.buffers.view(i, pool.store_dtype, (pool.head_num, pool.head_dim)) for i in range(layers)]
    pool.v_buffer = [
        kv.buffers.view(layers + i, pool.store_dtype, (pool.head_num, pool.v_head_dim)) for i in range(layers)
    ]
    pool._memx_elastic = kv
    pool._kv_buffer_descs = pool._build_kv_buffer_descs()
    pool._init_data_ptrs_and_strides()


# ------------------------------------------------------------------ allocator
def after_clear(result, allocator, *args, **kwargs):
    kv = _elastic_of(allocator)
    if kv is not None:
        kv.restrict_free_list(allocator)
    return result


def after_available_size(result, allocator, *args, **kwargs):
    kv = _elastic_of(allocator)
    if kv is None:
        return result
    return result + kv.growable_pages() * allocator.page_size


def around_alloc(original, allocator, need_size, *args, **kwargs):
    kv = _elastic_of(allocator)
    if kv is not None:
        kv.grow(allocator, -(-int(need_size) // allocator.page_size))
    return original(allocator, need_size, *args, **kwargs)


def around_alloc_extend(
    original,
    allocator,
    prefix_lens,
    prefix_lens_cpu,
    seq_lens,
    seq_lens_cpu,
    last_loc,
    extend_num_tokens,
    *args,
    **kwargs,
):
    kv = _elastic_of(allocator)
    if kv is not None:  # upstream's own bound on the pages one extend can take
        kv.grow(allocator, int(extend_num_tokens) // allocator.page_size + len(prefix_lens) + 1)
    return original(
        allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, *args, **kwargs
    )


def around_alloc_decode(original, allocator, seq_lens, *args, **kwargs):
    kv = _elastic_of(allocator)
    if kv is not None:
        kv.grow(allocator, len(seq_lens))
    return original(allocator, seq_lens, *args, **kwargs)


def around_check_decode_capacity(original, allocator, *args, **kwargs):
    kv = _elastic_of(allocator)
    if kv is None:
        return original(allocator, *args, **kwargs)
    from sglang_memx.elastic.driver import borrow_tokens, reserve_activation

    requests = kwargs.get("requests")
    if requests is not None and not reserve_activation(
        kv, allocator, kwargs.get("tree_cache"), len(requests), len(requests), urgent=True
    ):
        return False  # the step's activation does not fit: upstream retracts a request and asks again
    if kv.lent is None:
        return original(allocator, *args, **kwargs)
    need = int(kwargs.get("num_tokens", 0))
    borrow_tokens(kv, need - allocator.available_size(), may_wait=False)  # what is free at once
    if original(allocator, *args, **kwargs):
        return True
    # still short after evicting our own cache: let the arbiter reclaim from idle peers
    # before upstream retracts (or aborts) a running request
    if borrow_tokens(kv, need - allocator.available_size(), may_wait=True, urgent=True):
        return original(allocator, *args, **kwargs)
    return False


_A = "sglang.srt.mem_cache.allocator."
HOOKS = (
    HookSpec(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        "around",
        around_configure,
        expects=("self",),
        why="scope elastic KV to the pool build; check the result",
    ),
    HookSpec(
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers",
        "around",
        around_create_buffers,
        expects=("self",),
        why="K/V buffers as views over pooled groups",
    ),
    HookSpec(_A + "token.TokenToKVPoolAllocator.clear", "after", after_clear, expects=("self",)),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.clear", "after", after_clear, expects=("self",)),
    HookSpec(_A + "token.TokenToKVPoolAllocator.available_size", "after", after_available_size, expects=("self",)),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.available_size", "after", after_available_size, expects=("self",)),
    HookSpec(_A + "token.TokenToKVPoolAllocator.alloc", "around", around_alloc, expects=("self", "need_size")),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.alloc", "around", around_alloc, expects=("self", "need_size")),
    HookSpec(
        _A + "paged.PagedTokenToKVPoolAllocator.alloc_extend",
        "around",
        around_alloc_extend,
        expects=("self", "prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc", "extend_num_tokens"),
    ),
    HookSpec(
        _A + "paged.PagedTokenToKVPoolAllocator.alloc_decode",
        "around",
        around_alloc_decode,
        expects=("self", "seq_lens"),
    ),
    HookSpec(
        _A + "base.BaseTokenToKVPoolAllocator.check_decode_capacity",
        "around",
        around_check_decode_capacity,
        expects=("self",),
    ),
)
