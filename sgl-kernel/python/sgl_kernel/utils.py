"""Small capability queries."""

from __future__ import annotations

__all__ = ["is_arch_support_pdl"]


def is_arch_support_pdl() -> bool:
    """Whether programmatic dependent launch (a Hopper+ CUDA feature) can be
    used. Always ``False`` for the portable kernels."""
    return False
