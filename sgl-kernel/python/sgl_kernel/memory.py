"""Tensor lifetime helpers."""

from __future__ import annotations

__all__ = ["weak_ref_tensor"]


def weak_ref_tensor(tensor):
    """Return ``tensor`` itself (non-tensors are returned unchanged).

    Upstream's CUDA op builds a second tensor over the same memory that does
    not keep the storage alive (for CUDA-graph output buffers). The portable
    kernels have no way to build such a non-owning tensor, so they return the
    very same object: the memory is shared as upstream promises, but the
    result *does* keep the storage alive. Callers only rely on the sharing.
    """
    return tensor
