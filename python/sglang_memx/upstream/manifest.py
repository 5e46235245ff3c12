"""Every upstream SGLang name memx reads, calls or patches, declared once.

``test/upstream_compat/test_manifest.py`` checks this table against the installed
SGLang (each class, function and constant resolves; each member exists on its class,
as a method, property, field or an attribute its ``__init__`` or another method
assigns; each callable takes the leading parameters listed) and checks the adapter
modules against it (every attribute they read on an upstream object, through the
parameter names of ``ROLES``, is declared here). A name missing upstream fails there
and, at run time, raises where it is read: memx never falls back silently.

* ``CLASSES``: short name -> dotted path.
* ``MEMBERS``: short class name -> {member: short class name of its value, or None}.
* ``PARAMS``: "Class.method" or a dotted function path -> leading parameters memx passes.
* ``OBJECTS``: module-level functions, constants and objects memx uses.
* ``TARGETS``: hook targets (dotted) -> leading parameters the hook relies on.
* ``ROLES``: parameter / variable names the adapter modules use for upstream objects.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

_M = "sglang.srt.managers."
_C = "sglang.srt.mem_cache."
_U = "sglang.srt.model_executor.model_runner_components.weight_updater."

CLASSES: dict[str, str] = {
    "ServerArgs": "sglang.srt.server_args.ServerArgs",
    "HookRegistry": "sglang.srt.plugins.hook_registry.HookRegistry",
    "HookType": "sglang.srt.plugins.hook_registry.HookType",
    "Scheduler": _M + "scheduler.Scheduler",
    "ScheduleBatch": _M + "schedule_batch.ScheduleBatch",
    "Req": _M + "schedule_batch.Req",
    "ReqKvInfo": _M + "schedule_batch.ReqKvInfo",
    "SamplingParams": "sglang.srt.sampling.sampling_params.SamplingParams",
    "AbortReq": _M + "io_struct.AbortReq",
    "GetInternalStateReqOutput": _M + "io_struct.GetInternalStateReqOutput",
    "SetInternalStateReq": _M + "io_struct.SetInternalStateReq",
    "SetInternalStateReqOutput": _M + "io_struct.SetInternalStateReqOutput",
    "ForwardMode": "sglang.srt.model_executor.forward_batch_info.ForwardMode",
    "ForwardBatch": "sglang.srt.model_executor.forward_batch_info.ForwardBatch",
    "ModelRunner": "sglang.srt.model_executor.model_runner.ModelRunner",
    "WeightUpdater": "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater",
    "LlamaForCausalLM": "sglang.srt.models.llama.LlamaForCausalLM",
    "LlamaModel": "sglang.srt.models.llama.LlamaModel",
    "Gemma2ForCausalLM": "sglang.srt.models.gemma2.Gemma2ForCausalLM",
    "Gemma2Model": "sglang.srt.models.gemma2.Gemma2Model",
    "PrefillAdder": _M + "schedule_policy.PrefillAdder",
    "AddReqResult": _M + "schedule_policy.AddReqResult",
    "PrefillBudget": _C + "prefill_budget.PrefillBudget",
    "NewTokenRatioTracker": _M + "scheduler_components.new_token_ratio_tracker.NewTokenRatioTracker",
    "SchedulerInternalStateController": _M + "scheduler_components.internal_state.SchedulerInternalStateController",
    "SchedulerPoolStatsObserver": _M + "scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver",
    "PoolStats": _M + "scheduler_components.pool_stats_observer.PoolStats",
    "KVCacheConfigurator": _C + "kv_cache_configurator.KVCacheConfigurator",
    "KVCacheConfigResult": _C + "kv_cache_configurator.KVCacheConfigResult",
    "ModelConfig": "sglang.srt.configs.model_config.ModelConfig",
    "KVCache": _C + "memory_pool.KVCache",
    "GroupCoordinator": "sglang.srt.distributed.parallel_state.GroupCoordinator",
    "MHATokenToKVPool": _C + "memory_pool.MHATokenToKVPool",
    "MLATokenToKVPool": _C + "memory_pool.MLATokenToKVPool",
    "ReqToTokenPool": _C + "memory_pool.ReqToTokenPool",
    "BaseTokenToKVPoolAllocator": _C + "allocator.base.BaseTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator": _C + "allocator.token.TokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator": _C + "allocator.paged.PagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator": _C + "allocator.swa.SWATokenToKVPoolAllocator",
    "SWAKVPool": _C + "swa_memory_pool.SWAKVPool",
    "BasePrefixCache": _C + "base_prefix_cache.BasePrefixCache",
    "EvictParams": _C + "base_prefix_cache.EvictParams",
    "EvictResult": _C + "base_prefix_cache.EvictResult",
    "MatchPrefixParams": _C + "base_prefix_cache.MatchPrefixParams",
    "MatchResult": _C + "base_prefix_cache.MatchResult",
    "InsertParams": _C + "base_prefix_cache.InsertParams",
    "RadixKey": _C + "radix_cache.RadixKey",
    "MemoryPoolConfig": "sglang.srt.model_executor.pool_configurator.MemoryPoolConfig",
    "RadixAttention": "sglang.srt.layers.radix_attention.RadixAttention",
    "FINISH_ABORT": _M + "schedule_batch.FINISH_ABORT",
    "RadixCache": _C + "radix_cache.RadixCache",
    "UnifiedRadixCache": _C + "unified_radix_cache.UnifiedRadixCache",
    "InsertResult": _C + "base_prefix_cache.InsertResult",
    "GlobalState": "sglang.srt.entrypoints.http_server._GlobalState",
    "TokenizerManager": _M + "tokenizer_manager.TokenizerManager",
    "IdleSleeper": _M + "scheduler_components.idle_sleeper.IdleSleeper",
}

MEMBERS: dict[str, dict[str, str | None]] = {
    "ServerArgs": {"disable_radix_cache": None, "enable_hierarchical_cache": None, "model_path": None,
                   "host": None, "port": None, "chunked_prefill_size": None,
                   "max_prefill_tokens": None,
                   "device": None, "disable_cuda_graph": None, "disable_decode_cuda_graph": None,
                   "disable_prefill_cuda_graph": None, "cuda_graph_backend_decode": None,
                   "cuda_graph_backend_prefill": None, "cuda_graph_config": None, "page_size": None,
                   "tp_size": None, "pp_size": None, "disable_hybrid_swa_memory": None},
    "HookRegistry": {"register": None},
    "GroupCoordinator": {"cpu_group": None},
    "HookType": {"BEFORE": None, "AFTER": None, "AROUND": None, "REPLACE": None},
    "Scheduler": {
        "token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator", "tree_cache": "BasePrefixCache",
        "server_args": "ServerArgs", "waiting_queue": None, "running_batch": "ScheduleBatch",
        "last_batch": "ScheduleBatch", "chunked_req": "Req", "page_size": None, "chunked_prefill_size": None,
        "max_total_num_tokens": None, "new_token_ratio_tracker": "NewTokenRatioTracker", "max_req_len": None,
        "max_req_input_len": None, "req_to_token_pool": "ReqToTokenPool", "hisparse_coordinator": None,
        "_add_request_to_queue": None, "abort_request": None, "idle_sleeper": "IdleSleeper",
        "get_num_allocatable_reqs": None, "send_abort_output": None, "max_prefill_tokens": None,
    },
    "IdleSleeper": {"poller": None},
    "ScheduleBatch": {"reqs": None, "forward_mode": "ForwardMode",
                      "token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator",
                      "req_to_token_pool": "ReqToTokenPool", "batch_is_full": None, "filter_batch": None,
                      "extend_num_tokens": None},
    "ForwardMode": {"is_extend": None, "is_decode": None, "is_mixed": None},
    "NewTokenRatioTracker": {"current": None},
    "ReqToTokenPool": {"req_to_token": None},
    "Req": {
        "rid": None, "origin_input_ids": None, "output_ids": None, "sampling_params": "SamplingParams",
        "finished": None, "full_untruncated_fill_ids": None, "prefix_len": None, "kv": "ReqKvInfo",
        "owned_kv_len": None, "extra_key": None, "cache_salt": None, "is_retracted": None,
        "return_logprob": None, "grammar": None, "input_embeds": None, "multimodal_inputs": None,
        "session": None, "beam_group": None, "lora_id": None, "to_finish": None, "finished_output": None,
    },
    "ReqKvInfo": {"kv_allocated_len": None, "holds_kv": None, "req_pool_idx": None},
    "SamplingParams": {"max_new_tokens": None, "ignore_eos": None},
    "AbortReq": {"abort_all": None, "rid": None, "abort_message": None, "finished_reason": None},
    "GetInternalStateReqOutput": {"internal_state": None},
    "SetInternalStateReq": {"server_args": None},
    "SetInternalStateReqOutput": {"updated": None},
    "PrefillAdder": {
        "token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator", "tree_cache": "BasePrefixCache",
        "memory_budget": "PrefillBudget", "can_run_list": None, "running_batch": "ScheduleBatch",
        "page_size": None, "rem_chunk_tokens": None, "rem_input_tokens": None, "new_chunked_req": None,
        "new_token_ratio": None,
    },
    "AddReqResult": {"NO_TOKEN": None, "CONTINUE": None, "OTHER": None},
    "PrefillBudget": {"total_offset": None, "current_offset": None, "remaining_current": None,
                      "remaining_total": None, "reserve": None},
    "SchedulerInternalStateController": {"scheduler": "Scheduler"},
    "SchedulerPoolStatsObserver": {"token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator"},
    "PoolStats": {"full_num_used": None, "full_available_size": None, "full_evictable_size": None,
                  "full_token_usage": None},
    "KVCacheConfigurator": {"server_args": "ServerArgs", "model_config": "ModelConfig", "model_dtype": None,
                            "is_draft_worker": None, "kv_cache_dtype": None, "is_hybrid_swa": None,
                            "use_mla_backend": None, "mambaish_config": None},
    "KVCacheConfigResult": {"token_to_kv_pool": "KVCache", "token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator",
                            "req_to_token_pool": "ReqToTokenPool"},
    "ModelConfig": {"hf_text_config": None, "num_hidden_layers": None, "hf_config": None},
    # the layer stream cache (upstream.layer_stream)
    "MemoryPoolConfig": {"max_total_num_tokens": None},
    "RadixAttention": {"layer_id": None},
    "FINISH_ABORT": {"to_json": None},
    "KVCache": {"dtype": None, "store_dtype": None, "device": None, "layer_num": None, "mem_usage": None},
    "MHATokenToKVPool": {
        "dtype": None, "store_dtype": None, "size": None, "page_size": None, "head_num": None, "head_dim": None,
        "v_head_dim": None, "layer_num": None, "device": None, "is_quantized_kv_cache": None,
        "post_capture_active": None, "kv_cache_layout": None, "k_buffer": None, "v_buffer": None,
        "get_kv_size_bytes": None, "enable_custom_mem_pool": None,
    },
    "MLATokenToKVPool": {
        "dtype": None, "store_dtype": None, "size": None, "page_size": None, "layer_num": None, "device": None,
        "kv_lora_rank": None, "qk_rope_head_dim": None, "kv_cache_dim": None, "kv_buffer": None, "use_dsa": None,
        "post_capture_active": None, "layer_shard_enabled": None, "get_kv_size_bytes": None,
        "enable_custom_mem_pool": None,
    },
    "BaseTokenToKVPoolAllocator": {
        "page_size": None, "free_pages": None, "release_pages": None, "merge_and_sort_free": None,
        "get_all_free_pages": None, "available_size": None, "get_kvcache": "KVCache", "alloc": None, "free": None,
    },
    "PagedTokenToKVPoolAllocator": {"staged_pages": None, "num_staged_pages": None},
    "SWATokenToKVPoolAllocator": {"full_attn_allocator": "BaseTokenToKVPoolAllocator",
                                  "swa_attn_allocator": "BaseTokenToKVPoolAllocator", "swa_req_ring": None},
    "SWAKVPool": {"full_kv_pool": "MHATokenToKVPool", "swa_kv_pool": "MHATokenToKVPool"},
    "BasePrefixCache": {"evictable_size": None, "supports_prefix_sharing": None, "evict": "EvictResult",
                        "match_prefix": "MatchResult", "lock": None, "unlock": None},
    "RadixCache": {"insert": None},
    "EvictParams": {"num_tokens": None},
    "EvictResult": {"num_tokens_evicted": None},
    "MatchPrefixParams": {"key": "RadixKey", "req": "Req"},
    "MatchResult": {"device_prefix_len": None, "last_device_node": None, "host_hit_length": None},
    # the peer KV tier (upstream.peer_radix)
    "UnifiedRadixCache": {"path_device_indices": None, "insert": "InsertResult",
                          "token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator"},
    "InsertResult": {"prefix_len": None},
    "RadixKey": {"is_bigram": None, "extra_key": None, "cache_salt": None, "raw_token_ids": None},
    "InsertParams": {"key": "RadixKey", "value": None, "prev_prefix_len": None},
    "ModelRunner": {"token_to_kv_pool_allocator": "BaseTokenToKVPoolAllocator", "device": None,
                    "model": "LlamaForCausalLM", "server_args": "ServerArgs"},
    "WeightUpdater": {"get_model_runner": None},
    # remappable weights: the decoder layers of a causal LM shaped like Llama's (most SGLang models)
    "LlamaForCausalLM": {"model": "LlamaModel", "start_layer": None, "end_layer": None},
    "LlamaModel": {"layers": None},
    # ... and Gemma2's (no pipeline stages: no start_layer / end_layer, every layer in the process)
    "Gemma2ForCausalLM": {"model": "Gemma2Model"},
    "Gemma2Model": {"layers": None},
    "ForwardBatch": {"input_ids": None, "batch_size": None, "forward_mode": "ForwardMode",
                     "req_pool_indices": None, "seq_lens": None, "out_cache_loc": None},
    "GlobalState": {"tokenizer_manager": "TokenizerManager"},
    "TokenizerManager": {"get_internal_state": None, "set_internal_state": None},
}  # fmt: skip

PARAMS: dict[str, tuple[str, ...]] = {
    "Scheduler._add_request_to_queue": ("self", "req", "is_retracted"),
    "Scheduler.abort_request": ("self", "recv_req"),
    "Scheduler.send_abort_output": ("self", "abort_req", "req"),
    "ScheduleBatch.filter_batch": ("self", "reqs_to_exclude"),
    "PrefillBudget.reserve": ("self", "extend_input_len", "max_new_tokens"),
    "PrefillBudget.__init__": ("self", "allocator", "tree_cache"),
    "RadixKey.__init__": ("self", "token_ids", "extra_key"),
    "BasePrefixCache.evict": ("self", "params"),
    "BasePrefixCache.match_prefix": ("self", "params"),
    "RadixCache.insert": ("self", "params"),
    "UnifiedRadixCache.path_device_indices": ("self", "node"),
    "BasePrefixCache.lock": ("self", "node"),
    "BasePrefixCache.unlock": ("self", "lock"),
    "BaseTokenToKVPoolAllocator.alloc": ("self", "need_size"),
    "BaseTokenToKVPoolAllocator.free": ("self", "free_index"),
    "HookRegistry.register": ("cls", "target", "hook", "hook_type"),
    _M + "schedule_batch.release_req": ("req", "remaing_req_count", "req_to_token_pool", "token_to_kv_pool_allocator",
                                        "tree_cache", "hisparse_coordinator", "offload_kv"),
    "sglang.srt.utils.auth.add_api_key_middleware": ("app", "api_key", "admin_api_key"),
    "sglang.srt.utils.auth.auth_level": ("level",),
    "sglang.srt.configs.model_config.is_hybrid_swa_model": ("model_architectures", "hf_text_config"),
}  # fmt: skip

OBJECTS: dict[str, str] = {
    _M + "schedule_batch.release_req": "function",
    _M + "schedule_policy.CLIP_MAX_NEW_TOKENS": "constant",
    "sglang.srt.entrypoints.http_server.app": "object",
    "sglang.srt.entrypoints.http_server.get_global_state": "function",
    "sglang.srt.utils.auth.add_api_key_middleware": "function",
    "sglang.srt.utils.auth.auth_level": "function",
    "sglang.srt.utils.auth.AuthLevel.ADMIN_OPTIONAL": "constant",  # /set_internal_state's level
    "sglang.srt.configs.model_config.is_hybrid_swa_model": "function",
    "sglang.srt.distributed.parallel_state.get_tp_group": "function",  # .cpu_group: the ranks' gloo group
    # its process title, set before it loads plugins, tells the plugin where it is (upstream.process)
    _M + "detokenizer_manager.run_detokenizer_process": "function",
}

_A = _C + "allocator."
_SC = _M + "scheduler_components."
TARGETS: dict[str, tuple[str, ...]] = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("parser",),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("cls", "args"),
    "sglang.srt.entrypoints.http_server.launch_server": ("server_args",),
    _SC + "internal_state.SchedulerInternalStateController.get_internal_state": ("self", "recv_req"),
    _SC + "internal_state.SchedulerInternalStateController.set_internal_state": ("self", "recv_req"),
    _M + "scheduler.Scheduler.get_next_batch_to_run": ("self",),
    _M + "scheduler.Scheduler.abort_request": ("self", "recv_req"),
    _M + "scheduler.Scheduler.process_batch_result": ("self", "batch", "result"),
    _M + "schedule_policy.PrefillAdder.add_one_req": ("self", "req", "has_chunked_req", "truncation_align_size"),
    _M + "schedule_policy.PrefillAdder.add_chunked_req": ("self", "req"),
    _M + "schedule_batch.ScheduleBatch.release_req": ("self", "idx", "remaing_req_count", "offload_kv"),
    _SC + "pool_stats_observer.SchedulerPoolStatsObserver._get_token_info": ("self",),
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": ("self", "forward_batch"),
    "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool": ("self",),
    _U + "WeightUpdater.update_weights_from_disk": ("self",),
    _U + "WeightUpdater.update_weights_from_tensor": ("self",),
    _U + "WeightUpdater.load_weights_from_distributed": ("self",),
    _U + "WeightUpdater.update_weights_from_ipc": ("self",),
    _C + "kv_cache_configurator.KVCacheConfigurator.configure": ("self",),
    _C + "memory_pool.MHATokenToKVPool._create_buffers_normal": ("self",),
    _C + "memory_pool.MLATokenToKVPool._create_buffers": ("self",),
    _A + "token.TokenToKVPoolAllocator.clear": ("self",),
    _A + "paged.PagedTokenToKVPoolAllocator.clear": ("self",),
    _A + "token.TokenToKVPoolAllocator.available_size": ("self",),
    _A + "paged.PagedTokenToKVPoolAllocator.available_size": ("self",),
    _A + "swa.SWATokenToKVPoolAllocator.swa_capacity_and_available": ("self",),
    _A + "token.TokenToKVPoolAllocator.alloc": ("self", "need_size"),
    _A + "paged.PagedTokenToKVPoolAllocator.alloc": ("self", "need_size"),
    _A + "paged.PagedTokenToKVPoolAllocator.alloc_extend": ("self", "prefix_lens", "prefix_lens_cpu", "seq_lens",
                                                             "seq_lens_cpu", "last_loc", "extend_num_tokens"),
    _A + "paged.PagedTokenToKVPoolAllocator.alloc_decode": ("self", "seq_lens", "seq_lens_cpu", "last_loc"),
    _A + "base.BaseTokenToKVPoolAllocator.check_decode_capacity": ("self",),
    _A + "base.BaseTokenToKVPoolAllocator.create_prefill_budget": ("self", "tree_cache"),
    _C + "unified_radix_cache.UnifiedRadixCache._evict_device_leaf": ("self", "node_id", "tracker"),
    _C + "unified_radix_cache.UnifiedRadixCache.match_prefix": ("self", "params"),
    _C + "unified_radix_cache.UnifiedRadixCache.insert": ("self", "params"),
    _C + "kv_cache_configurator.KVCacheConfigurator.config_from_budget": ("self", "budget_bytes"),
    "sglang.srt.layers.radix_attention.RadixAttention.forward": ("self", "q", "k", "v", "forward_batch"),
}  # fmt: skip

# Names the adapter modules give upstream objects (parameters and locals) -> their class.
ROLES: dict[str, str] = {
    "scheduler": "Scheduler", "batch": "ScheduleBatch", "last": "ScheduleBatch", "req": "Req",
    "abort": "AbortReq", "adder": "PrefillAdder", "budget": "PrefillBudget", "allocator": "BaseTokenToKVPoolAllocator",
    "pool": "MHATokenToKVPool", "mla_pool": "MLATokenToKVPool", "swa_pool": "SWAKVPool",
    "swa_allocator": "SWATokenToKVPoolAllocator", "kvcache": "KVCache", "tree": "BasePrefixCache",
    "runner": "ModelRunner",
    "forward_batch": "ForwardBatch", "server_args": "ServerArgs", "args": "ServerArgs",
    "model_config": "ModelConfig", "configurator": "KVCacheConfigurator", "config_result": "KVCacheConfigResult",
    "controller": "SchedulerInternalStateController", "observer": "SchedulerPoolStatsObserver",
    "stats": "PoolStats", "state_reply": "GetInternalStateReqOutput", "global_state": "GlobalState",
    "set_req": "SetInternalStateReq",
    "matched": "MatchResult", "evicted": "EvictResult", "registry": "HookRegistry", "radix": "RadixCache",
    "sleeper": "IdleSleeper", "causal_lm": "LlamaForCausalLM", "lm_body": "LlamaModel",
    "unified": "UnifiedRadixCache", "match_params": "MatchPrefixParams", "insert_params": "InsertParams",
    "radix_key": "RadixKey", "pool_config": "MemoryPoolConfig", "attn_layer": "RadixAttention",
    "req_pool": "ReqToTokenPool", "paged_allocator": "PagedTokenToKVPoolAllocator",
}  # fmt: skip


def declared(path: str) -> bool:
    """Whether dotted ``path`` is a declared class, object or hook target."""
    return path in CLASSES.values() or path in OBJECTS or path in TARGETS


@functools.cache
def resolve(path: str):
    """Import and return the declared upstream object at dotted ``path`` (raises if undeclared or missing)."""
    if not declared(path):
        raise LookupError(f"{path} is not declared in sglang_memx.upstream.manifest")
    return pkgutil.resolve_name(path)


def resolve_member(target: str):
    """A hook target as it stands on its owner now (static and class methods unwrapped)."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path) if "." in owner_path else importlib.import_module(owner_path)
    raw = vars(owner).get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    return getattr(owner, attr)


def is_private(path: str) -> bool:
    """Whether a dotted upstream path goes through a private name (a segment starting with ``_``)."""
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))
