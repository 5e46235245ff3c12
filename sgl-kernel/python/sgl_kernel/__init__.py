"""Portable ``sgl_kernel``: the names upstream SGLang imports from ``sgl_kernel``,
for hosts where upstream's CUDA wheel (``sglang-kernel``) cannot load.

Distribution name: ``sglang-memx-portable-kernel``. Install it only on hosts
without CUDA. Ops with a plain-torch implementation work on any device torch
supports; every other name is bound to a callable that raises
:class:`sgl_kernel._unsupported.UnsupportedOpError` (a ``NotImplementedError``)
naming the op, so imports always succeed and unsupported calls fail loudly.

Each submodule lists its unsupported names in an ``UNSUPPORTED`` tuple.
Nothing here registers ``torch.ops.sgl_kernel`` operators: upstream turns on its
Intel AMX CPU path when ``torch.ops.sgl_kernel.convert_weight_packed`` exists,
and the portable kernels must leave it on its native torch path.
See docs/cpu-backend.md.
"""

__version__ = "0.1.0"

from sgl_kernel import (  # noqa: F401  (submodules upstream reaches as attributes)
    allreduce,
    attention,
    elementwise,
    flash_attn,
    gemm,
    kvcacheio,
    mamba,
    memory,
    metal,
    moe,
    quantization,
    sampling,
    scalar_type,
    spatial,
    speculative,
    utils,
)
from sgl_kernel._unsupported import UnsupportedOpError

# ---------------------------------------------------------------- unsupported
from sgl_kernel.attention import (
    flash_compress4_decode,
    flash_compress4_prefill,
    flash_compress128_decode,
    flash_compress128_prefill,
    flash_mla_decode,
    flash_mla_decode_get_workspace_size,
    flash_mla_get_workspace_size,
    flash_mla_prefill,
    flash_mla_prefill_get_workspace_size,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    fp8_paged_mqa_logits_triton,
    fused_hc_head,
    gdn_attention,
    hc_post,
    hc_split_sinkhorn,
    infllmv2_attn_stage1,
    max_pooling_1d_varlen,
    merge_state_v2,
    mhc_fused_post_pre,
    mhc_pre,
    plan_compress_decode,
    plan_compress_decode_legacy,
    plan_compress_prefill,
    plan_compress_prefill_legacy,
)

# ---------------------------------------------------------------- implemented
from sgl_kernel.elementwise import (
    compress_norm_rope_store,
    concat_mla_absorb_q,
    concat_mla_k,
    copy_to_gpu_no_ce,
    fused_add_rmsnorm,
    fused_inplace_qknorm_rope,
    fused_k_norm_rope_flashmla,
    fused_q_indexer_rope_hadamard_quant,
    fused_q_norm_rope,
    fused_qk_rope_with_cos_sin_cache_inplace,
    gelu_and_mul,
    gelu_quick,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    hadamard_transform,
    multimodal_rotary_embedding,
    rmsnorm,
    rotary_embedding,
    silu_and_mul,
    silu_and_mul_clamp,
)
from sgl_kernel.gemm import (
    awq_dequantize,
    cutlass_w4a8_moe_mm,
    es_fp8_blockwise_scaled_grouped_mm,
    es_sm100_mxfp8_blockscaled_grouped_mm,
    es_sm100_mxfp8_blockscaled_grouped_quant,
    fp8_blockwise_scaled_grouped_mm,
    fp8_scaled_mm,
    get_cutlass_w4a8_moe_mm_data,
    int8_scaled_mm,
    sgl_per_tensor_quant_fp8,
    sgl_per_token_quant_fp8,
    shuffle_rows,
)
from sgl_kernel.kvcacheio import (
    copy_all_layer_kv_cache_cpu,
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
    store_cache_xpu,
    transfer_cache_dsv4_mla,
    transfer_kv_all_layer,
    transfer_kv_all_layer_mla,
    transfer_kv_per_layer,
    transfer_kv_per_layer_mla,
)
from sgl_kernel.mamba import (
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
    chunk_gated_delta_rule_cpu,
)
from sgl_kernel.memory import weak_ref_tensor
from sgl_kernel.moe import (
    biased_topk,
    fast_topk_transform_fused,
    fast_topk_transform_ragged_fused,
    fast_topk_v2,
    fused_experts,
    hash_topk,
    minimax_decode_topk,
    moe_fused_gate,
    moe_sum,
    moe_sum_reduce,
    top_k,
    topk_sigmoid,
    topk_softmax,
)
from sgl_kernel.quantization import (
    ggml_dequantize,
    ggml_moe_a8,
    ggml_moe_a8_vec,
    ggml_mul_mat_a8,
    ggml_mul_mat_vec_a8,
)
from sgl_kernel.sampling import (
    apply_token_bitmask_inplace_cuda,
    min_p_sampling_from_probs,
    top_k_renorm_prob,
    top_k_top_p_sampling_from_probs,
    top_p_renorm_prob,
)
from sgl_kernel.speculative import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    reconstruct_indices_from_tree_mask,
    rotate_input_ids_cpu,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
    verify_tree_greedy_cpu,
)
