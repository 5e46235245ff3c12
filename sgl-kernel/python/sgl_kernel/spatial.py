"""CUDA green-context (SM partitioning) helpers used by PD multiplexing:
not available in the portable kernels."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    "create_greenctx_stream_by_value",
    "get_sm_available",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
