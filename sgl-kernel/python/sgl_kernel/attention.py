"""Attention kernels upstream imports from sgl_kernel: none has a portable
implementation. On the CPU path upstream attends with
``--attention-backend torch_native`` instead (see docs/cpu-backend.md)."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    # attention-state merge
    "merge_state_v2",
    # FlashMLA (dense, sparse, prefill/decode planning)
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "flash_mla_prefill",
    "flash_mla_decode",
    "flash_mla_get_workspace_size",
    "flash_mla_prefill_get_workspace_size",
    "flash_mla_decode_get_workspace_size",
    # compressed / sparse attention (DeepSeek-V4 style) and its indexer logits
    "flash_compress4_prefill",
    "flash_compress4_decode",
    "flash_compress128_prefill",
    "flash_compress128_decode",
    "plan_compress_prefill",
    "plan_compress_decode",
    "plan_compress_prefill_legacy",
    "plan_compress_decode_legacy",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "fp8_paged_mqa_logits_triton",
    # InfLLM-v2 sparse attention
    "infllmv2_attn_stage1",
    "max_pooling_1d_varlen",
    # gated delta-net attention (XPU)
    "gdn_attention",
    # DeepSeek-V4 hyper-connection blocks
    "hc_post",
    "hc_split_sinkhorn",
    "fused_hc_head",
    "mhc_pre",
    "mhc_fused_post_pre",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
