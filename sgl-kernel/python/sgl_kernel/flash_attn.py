"""FlashAttention-3 entry points: CUDA only, not implemented by the portable kernels."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    "flash_attn_with_kvcache",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "build_bidirectional_block_ids",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
