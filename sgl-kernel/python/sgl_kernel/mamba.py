"""State-space / linear-attention CPU kernels (causal conv1d, gated delta rule):
not implemented by the portable kernels, so hybrid linear-attention models
(Qwen3-Next and similar) are not on the supported CPU path."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
