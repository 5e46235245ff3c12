"""Mixture-of-experts routing / reduction and fused top-k selection kernels:
none has a portable implementation."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    # MoE
    "fused_experts",
    "moe_fused_gate",
    "moe_sum",
    "moe_sum_reduce",
    "topk_softmax",
    "topk_sigmoid",
    "biased_topk",
    "hash_topk",
    # top-k selection for sparse attention indexers
    "top_k",
    "fast_topk_v2",
    "fast_topk_transform_fused",
    "fast_topk_transform_ragged_fused",
    "minimax_decode_topk",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
