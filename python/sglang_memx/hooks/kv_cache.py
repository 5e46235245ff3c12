"""Upstream subsystem: KV cache (``sglang.srt.mem_cache``): elastic KV (``--memx-elastic-kv``).

* ``KVCacheConfigurator.configure`` (around): scopes the elastic build to this pool build
  (``coordinator.pool_build``), then checks that the pool and allocator it produced are kinds
  elastic KV supports (else a clear error naming the flag) and ties the allocator to the
  device's coordinator.
* ``MHATokenToKVPool._create_buffers_normal`` (around): for the plain MHA/GQA pool (NHD
  layout), the K/V buffers become views over pooled groups instead of zero-filled
  tensors; upstream then builds its descriptors and pointer tables from them as usual.
  ``MLATokenToKVPool._create_buffers`` (around): the same for the plain MLA pool's one latent
  buffer per layer (upstream builds its pointer table from them after the call).
* ``SWATokenToKVPoolAllocator.swa_capacity_and_available`` (after): a hybrid sliding-window
  model's pool statistics count each space's unmapped pages as free (``coordinator.swa_spaces``),
  as ``_get_token_info``'s hook does for one space: upstream's leak check adds them up.
* Token allocators: ``clear`` (after) keeps only mapped pages in the free list;
  ``available_size`` (after) adds the pages the pool could map now; ``alloc`` /
  ``alloc_extend`` / ``alloc_decode`` (around) map groups first when the free list is short
  in the coordinator's short-allocation order (``Coordinator.cover_allocation``: the local pool,
  a shared pool's borrow, the activation balloon; the tick premaps, so a steady decode step
  maps nothing here).
* ``BaseTokenToKVPoolAllocator.check_decode_capacity`` (around): the step's activation and,
  with a shared pool, a borrow before upstream retracts (``elastic.capacity``).
* ``BaseTokenToKVPoolAllocator.create_prefill_budget`` (around): the admission budget is
  upstream's ``PrefillBudget`` with a physical mode, for prefills offloaded to the host
  buffer (``upstream.scheduler.physical_budget_class``).
"""

from __future__ import annotations

from sglang_memx.coordinator import device, pool_build
from sglang_memx.coordinator.swa_spaces import SwaSpaces
from sglang_memx.elastic.capacity import decode_step_fits
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream.registry import HookSpec


def around_configure(original, configurator, *args, **kwargs):
    with pool_build.scope(configurator) as build:
        result = original(configurator, *args, **kwargs)
    if build is not None:
        pool_build.finish(build, result)
    return result


def around_create_buffers(original, pool):
    """The MHA pool's ``_create_buffers_normal`` or the MLA pool's ``_create_buffers``: views over
    pooled groups instead of zeroed tensors while an elastic build is open."""
    if not pool_build.make_elastic(pool):
        original(pool)


def after_clear(result, allocator):
    coordinator = device.of(allocator)
    if coordinator is not None:
        coordinator.kv.restrict_free_list(allocator)


def after_available_size(result, allocator):
    coordinator = device.of(allocator)
    if coordinator is None:
        return result
    swa = coordinator.part(SwaSpaces)  # one of a hybrid sliding-window model's sub-allocators
    if swa is not None:
        return swa.available_tokens(allocator, result)
    return result + coordinator.kv.growable_pages() * up_kv.page_size(allocator)


def after_swa_capacity_and_available(result, allocator, *args, **kwargs):
    coordinator = device.of(allocator)
    swa = None if coordinator is None else coordinator.part(SwaSpaces)
    return result if swa is None else swa.logical(result)


def around_alloc(original, allocator, need_size):
    coordinator = device.of(allocator)
    if coordinator is not None:
        coordinator.cover_allocation(allocator, -(-int(need_size) // up_kv.page_size(allocator)))
    return original(allocator, need_size)


def around_alloc_extend(original, allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                        extend_num_tokens, *args, **kwargs):  # fmt: skip
    coordinator = device.of(allocator)
    if coordinator is not None:  # upstream's own bound on the pages one extend can take
        coordinator.cover_allocation(
            allocator, int(extend_num_tokens) // up_kv.page_size(allocator) + len(prefix_lens) + 1
        )
    return original(allocator, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                    *args, **kwargs)  # fmt: skip


def around_alloc_decode(original, allocator, seq_lens, seq_lens_cpu, last_loc):
    coordinator = device.of(allocator)
    if coordinator is not None:
        coordinator.cover_allocation(allocator, len(seq_lens))
    return original(allocator, seq_lens, seq_lens_cpu, last_loc)


def around_check_decode_capacity(original, allocator, *, num_tokens, tree_cache, requests=None, spec_algorithm=None):
    coordinator = device.of(allocator)

    def check() -> bool:
        return original(allocator, num_tokens=num_tokens, tree_cache=tree_cache, requests=requests,
                        spec_algorithm=spec_algorithm)  # fmt: skip

    if coordinator is None:
        return check()
    return decode_step_fits(coordinator.kv, allocator, check, int(num_tokens), tree_cache,
                            None if requests is None else len(requests),
                            activation=coordinator.activation_side(), lent=coordinator.borrow_pool())  # fmt: skip


def around_create_prefill_budget(original, allocator, tree_cache, *, num_mixed_decode_tokens=0):
    if device.of(allocator) is None:
        return original(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
    return up_sched.new_physical_budget(allocator, tree_cache, num_mixed_decode_tokens)


_A = "sglang.srt.mem_cache.allocator."
_WHY_FREE = "keep the free list inside mapped KV groups"
_WHY_AVAIL = "count the pages the pool could map now as available"
_WHY_GROW = "map KV groups before upstream takes pages from the free list"
HOOKS = (
    HookSpec("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure", "around", around_configure,
             "elastic_kv", "scope elastic KV to the pool build; check what it built"),
    HookSpec("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal", "around",
             around_create_buffers, "elastic_kv", "K/V buffers as views over pooled groups"),
    HookSpec("sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers", "around", around_create_buffers,
             "elastic_kv", "MLA latent buffers as views over pooled groups"),
    HookSpec(_A + "token.TokenToKVPoolAllocator.clear", "after", after_clear, "elastic_kv", _WHY_FREE),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.clear", "after", after_clear, "elastic_kv", _WHY_FREE),
    HookSpec(_A + "token.TokenToKVPoolAllocator.available_size", "after", after_available_size, "elastic_kv",
             _WHY_AVAIL),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.available_size", "after", after_available_size, "elastic_kv",
             _WHY_AVAIL),
    HookSpec(_A + "swa.SWATokenToKVPoolAllocator.swa_capacity_and_available", "after", after_swa_capacity_and_available,
             "elastic_kv", "count both sliding-window model spaces' unmapped pages as free in the leak check"),
    HookSpec(_A + "token.TokenToKVPoolAllocator.alloc", "around", around_alloc, "elastic_kv", _WHY_GROW),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.alloc", "around", around_alloc, "elastic_kv", _WHY_GROW),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.alloc_extend", "around", around_alloc_extend, "elastic_kv",
             _WHY_GROW),
    HookSpec(_A + "paged.PagedTokenToKVPoolAllocator.alloc_decode", "around", around_alloc_decode, "elastic_kv",
             _WHY_GROW),
    HookSpec(_A + "base.BaseTokenToKVPoolAllocator.check_decode_capacity", "around", around_check_decode_capacity,
             "elastic_kv", "reserve a decode step's activation; borrow before upstream retracts"),
    HookSpec(_A + "base.BaseTokenToKVPoolAllocator.create_prefill_budget", "around", around_create_prefill_budget,
             "elastic_kv", "admission budget with a physical mode for prefills offloaded to the host buffer"),
)  # fmt: skip
