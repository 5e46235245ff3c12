"""Apple Metal kernels: not part of the portable kernels.

Upstream's MLX backend imports this module and checks ``_metal`` /
``_IMPORT_ERROR`` before use; both say the native extension is absent, so it
reports a clear error instead of calling into it.
"""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

_metal = None
_IMPORT_ERROR = ImportError("the portable sgl_kernel (sglang-memx-portable-kernel) ships no Metal extension")

UNSUPPORTED = ("rope_pool_fused",)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
