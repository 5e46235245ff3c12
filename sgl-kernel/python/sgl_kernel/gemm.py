"""Quantised GEMM and activation-quantisation kernels: none has a portable
implementation (upstream's CPU path runs unquantised dense models with torch matmuls)."""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    "int8_scaled_mm",
    "fp8_scaled_mm",
    "fp8_blockwise_scaled_grouped_mm",
    "es_fp8_blockwise_scaled_grouped_mm",
    "es_sm100_mxfp8_blockscaled_grouped_mm",
    "es_sm100_mxfp8_blockscaled_grouped_quant",
    "cutlass_w4a8_moe_mm",
    "get_cutlass_w4a8_moe_mm_data",
    "awq_dequantize",
    "sgl_per_tensor_quant_fp8",
    "sgl_per_token_quant_fp8",
    "shuffle_rows",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
