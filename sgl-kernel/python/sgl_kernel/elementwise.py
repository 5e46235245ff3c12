"""Normalisation, gated activations and rotary embedding in plain torch.

Every op here runs on whatever device its tensors live on (CPU on the hosts
this package is installed on). Arithmetic happens in float32 and the result is
cast back to the dtype of the tensor it is written into, once, at the end.
Argument names and order follow the ops upstream SGLang calls; ``enable_pdl``
(a CUDA launch hint) is accepted and ignored.
"""

from __future__ import annotations

import torch

from sgl_kernel._unsupported import define_unsupported

__all__ = [
    "rmsnorm",
    "fused_add_rmsnorm",
    "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gelu_quick",
    "rotary_embedding",
    "copy_to_gpu_no_ce",
]


# --------------------------------------------------------------------- norms
def _rms_scale(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keeping it (float32 in, float32 out)."""
    return torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)


def _check_norm_args(input: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(f"weight must have shape ({input.shape[-1]},), got {tuple(weight.shape)}")


def _write(result32: torch.Tensor, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result32.to(like.dtype)
    if out.shape != like.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(like.shape)}")
    out.copy_(result32)
    return out


def _norm(input, weight, eps, out, weight_offset: float):
    _check_norm_args(input, weight)
    x = input.float()
    w = weight.float() + weight_offset if weight_offset else weight.float()
    return _write(x * _rms_scale(x, eps) * w, out, input)


def _fused_add_norm(input, residual, weight, eps, weight_offset: float) -> None:
    _check_norm_args(input, weight)
    if residual.shape != input.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, input {tuple(input.shape)}")
    total = input.float() + residual.float()
    residual.copy_(total)
    w = weight.float() + weight_offset if weight_offset else weight.float()
    input.copy_(total * _rms_scale(total, eps) * w)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """RMS normalisation over the last dimension.

    Contract: ``y = x / sqrt(mean(x**2, -1) + eps) * weight`` with ``x`` of shape
    ``(..., hidden)`` and ``weight`` of shape ``(hidden,)``. Computed in float32,
    returned in ``input.dtype``. With ``out`` given, ``y`` is written into it
    (same shape as ``input``) and ``out`` is returned; ``input`` is never modified.
    """
    return _norm(input, weight, eps, out, 0.0)


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """Residual add followed by RMS normalisation, both in place.

    Contract: with ``s = input + residual`` (float32), afterwards
    ``residual == s`` (in residual's dtype) and ``input == rmsnorm(s, weight, eps)``
    (in input's dtype). The norm uses the float32 sum, not the rounded residual.
    Returns ``None``.
    """
    _fused_add_norm(input, residual, weight, eps, 0.0)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma-style RMS normalisation: like :func:`rmsnorm` with ``weight + 1`` as the scale.

    Contract: ``y = x / sqrt(mean(x**2, -1) + eps) * (1 + weight)``; ``out`` as in
    :func:`rmsnorm`.
    """
    return _norm(input, weight, eps, out, 1.0)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """Gemma-style :func:`fused_add_rmsnorm`: ``residual += input`` then
    ``input = gemma_rmsnorm(residual)``, both in place. Returns ``None``."""
    _fused_add_norm(input, residual, weight, eps, 1.0)


# --------------------------------------------------------------- activations
def _gated(input: torch.Tensor, out: torch.Tensor | None, act) -> torch.Tensor:
    d = input.shape[-1] // 2
    if input.shape[-1] != 2 * d:
        raise ValueError(f"last dim of input must be even, got {input.shape[-1]}")
    expected = input.shape[:-1] + (d,)
    if out is not None and out.shape != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(expected)}")
    x = input.float()
    result = act(x[..., :d]) * x[..., d:]
    if out is None:
        return result.to(input.dtype)
    out.copy_(result)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate: for ``input = [a | b]`` split in half on the last dim,
    returns ``silu(a) * b`` with ``silu(a) = a * sigmoid(a)``; shape ``(..., d)``
    for input ``(..., 2d)``. With ``out`` given it is written and returned."""
    return _gated(input, out, torch.nn.functional.silu)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU gate with exact GELU: ``gelu(a) * b`` where
    ``gelu(a) = a * (1 + erf(a / sqrt(2))) / 2``; halves and ``out`` as in
    :func:`silu_and_mul`."""
    return _gated(input, out, lambda a: torch.nn.functional.gelu(a, approximate="none"))


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU gate with the tanh GELU approximation:
    ``gelu(a) = a/2 * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))``, times ``b``;
    halves and ``out`` as in :func:`silu_and_mul`."""
    return _gated(input, out, lambda a: torch.nn.functional.gelu(a, approximate="tanh"))


def gelu_quick(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quick GELU, element-wise: ``x * sigmoid(1.702 * x)``. Output has the
    input's shape and dtype; with ``out`` given (same shape) it is written and returned."""
    if out is not None and out.shape != input.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(input.shape)}")
    x = input.float()
    result = x * torch.sigmoid(1.702 * x)
    if out is None:
        return result.to(input.dtype)
    out.copy_(result)
    return out


# ---------------------------------------------------------------------- rope
def _rotate_inplace(
    x: torch.Tensor,
    num_tokens: int,
    head_size: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate the leading ``rotary_dim`` channels of every head of ``x`` in place.

    ``cos``/``sin`` are float32 of shape (num_tokens, 1, rotary_dim // 2).
    """
    half = cos.shape[-1]
    try:
        heads = x.view(num_tokens, -1, head_size)
    except RuntimeError:  # strides do not allow a view: work on a copy, write back below
        heads = None
    work = heads if heads is not None else x.reshape(num_tokens, -1, head_size).clone()
    rot = work[..., : 2 * half].float()
    if is_neox:
        first, second = rot[..., :half], rot[..., half:]
    else:
        first, second = rot[..., 0::2], rot[..., 1::2]
    new_first = first * cos - second * sin
    new_second = second * cos + first * sin
    if is_neox:
        rotated = torch.cat((new_first, new_second), dim=-1)
    else:
        rotated = torch.stack((new_first, new_second), dim=-1).flatten(-2)
    work[..., : 2 * half].copy_(rotated)
    if heads is None:
        x.copy_(work.reshape(x.shape))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Apply rotary position embedding to ``query`` and ``key`` in place.

    Contract:
      * ``positions``: integer tensor of any shape; ``n = positions.numel()`` tokens.
      * ``query`` / ``key``: ``n * num_heads * head_size`` elements laid out as
        ``(n, num_heads, head_size)`` -- e.g. ``(n, heads * head_size)`` or
        ``(n, heads, head_size)`` or ``(batch, seq, ...)``; ``key`` may be ``None``
        and may have a different head count than ``query``.
      * ``cos_sin_cache``: ``(max_position, rotary_dim)``, row ``p`` holding
        ``cos(p * f_i)`` for ``i < rotary_dim/2`` followed by ``sin(p * f_i)``.
      * Only the first ``rotary_dim`` channels of each head rotate; the rest are
        untouched. With ``is_neox`` the pair for frequency ``i`` is channels
        ``(i, i + rotary_dim/2)``; otherwise (GPT-J style) it is ``(2i, 2i + 1)``.
        Each pair ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)``.
      * Arithmetic in float32; results are cast to the tensors' dtype. Returns ``None``.
    """
    pos = positions.reshape(-1).long()
    num_tokens = pos.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
    cache = cos_sin_cache.index_select(0, pos.to(cos_sin_cache.device)).float()
    cache = cache.to(query.device)
    half = rotary_dim // 2
    cos = cache[:, None, :half]
    sin = cache[:, None, half:]
    for x in (query, key):
        if x is None or x.numel() == 0:
            continue
        if x.numel() % (num_tokens * head_size):
            raise ValueError(f"tensor of shape {tuple(x.shape)} is not (tokens={num_tokens}, heads, {head_size})")
        _rotate_inplace(x, num_tokens, head_size, cos, sin, is_neox)


# ---------------------------------------------------------------------- misc
def copy_to_gpu_no_ce(input: torch.Tensor, output: torch.Tensor) -> None:
    """Copy ``input`` into ``output`` (same number of elements), any devices.

    Upstream uses this to move a small host array to the GPU without the copy
    engine; here it is an ordinary ``output.copy_(input)``. Returns ``None``.
    """
    if input.numel() != output.numel():
        raise ValueError(f"size mismatch: {input.numel()} vs {output.numel()}")
    output.copy_(input.reshape(output.shape))


# Upstream names in this module without a portable implementation.
UNSUPPORTED = (
    "concat_mla_k",
    "concat_mla_absorb_q",
    "silu_and_mul_clamp",
    "multimodal_rotary_embedding",
    "fused_qk_rope_with_cos_sin_cache_inplace",
    "fused_inplace_qknorm_rope",
    "fused_q_norm_rope",
    "fused_k_norm_rope_flashmla",
    "fused_q_indexer_rope_hadamard_quant",
    "compress_norm_rope_store",
    "hadamard_transform",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ += list(UNSUPPORTED)
