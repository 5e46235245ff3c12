"""Between an engine's layer-major KV buffers and block-major peer blocks.

Engines keep one K and one V buffer per layer, indexed by token slot: ``k[layer][slot]`` is a
``(kv_heads, head_dim)`` row (SGLang's MHA token-to-KV pool, memx's ``LayeredKVBuffers`` views).
A peer block is ``(layer, k/v, token, head, dim)`` for ``block_tokens`` tokens (``layout``).
``gather_block`` copies the rows of one page's slots into a block, ``scatter_block`` back into
(other) slots; both check shapes and dtypes against the layout and name what does not fit.
``layout_of_buffers`` derives the layout from the buffers themselves, so a borrower announces
exactly what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import DTYPE_BYTES, PeerKVLayout


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: KV buffers of {dtype} are not supported by the peer tier")
    return name


def layout_of_buffers(
    k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor], block_tokens: int, model: str = ""
) -> PeerKVLayout:
    """The layout of per-layer ``(slots, kv_heads, head_dim)`` K and V buffers."""
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError(f"k_layers: {len(k_layers)} K buffers and {len(v_layers)} V buffers")
    shape, dtype = k_layers[0].shape[1:], k_layers[0].dtype
    if len(shape) != 2:
        raise ValueError(f"k_layers[0]: expected (slots, kv_heads, head_dim), got {tuple(k_layers[0].shape)}")
    for name, bufs in (("k_layers", k_layers), ("v_layers", v_layers)):
        for i, t in enumerate(bufs):
            if t.shape[1:] != shape or t.dtype != dtype:
                raise ValueError(f"{name}[{i}]: {tuple(t.shape)} {t.dtype}, layer 0 is (*, {tuple(shape)}) {dtype}")
    return PeerKVLayout(
        num_layers=len(k_layers),
        block_tokens=block_tokens,
        num_kv_heads=int(shape[0]),
        head_dim=int(shape[1]),
        dtype=_dtype_name(dtype),
        model=model,
    )


def _check(layout: PeerKVLayout, k_layers, v_layers, slots: torch.Tensor, block: torch.Tensor) -> None:
    if len(k_layers) != layout.num_layers or len(v_layers) != layout.num_layers:
        raise ValueError(f"k_layers: {len(k_layers)} layers, layout has {layout.num_layers}")
    if slots.dim() != 1 or slots.numel() != layout.block_tokens:
        raise ValueError(f"slots: expected {layout.block_tokens} slot indices, got shape {tuple(slots.shape)}")
    if tuple(block.shape) != layout.block_shape:
        raise ValueError(f"block: shape {tuple(block.shape)}, layout says {layout.block_shape}")
    if block.dtype != k_layers[0].dtype:
        raise ValueError(f"block: dtype {block.dtype}, the KV buffers hold {k_layers[0].dtype}")


def gather_block(layout: PeerKVLayout, k_layers, v_layers, slots: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``block[l, 0] = k[l][slots]``, ``block[l, 1] = v[l][slots]`` for every layer; returns ``block``."""
    slots = slots.to(device=k_layers[0].device, dtype=torch.int64)
    _check(layout, k_layers, v_layers, slots, block)
    for layer, (k, v) in enumerate(zip(k_layers, v_layers)):
        torch.index_select(k, 0, slots, out=block[layer, 0])
        torch.index_select(v, 0, slots, out=block[layer, 1])
    return block


def scatter_block(layout: PeerKVLayout, block: torch.Tensor, k_layers, v_layers, slots: torch.Tensor) -> None:
    """``k[l][slots] = block[l, 0]``, ``v[l][slots] = block[l, 1]`` for every layer."""
    slots = slots.to(device=k_layers[0].device, dtype=torch.int64)
    _check(layout, k_layers, v_layers, slots, block)
    for layer, (k, v) in enumerate(zip(k_layers, v_layers)):
        k.index_copy_(0, slots, block[layer, 0])
        v.index_copy_(0, slots, block[layer, 1])
