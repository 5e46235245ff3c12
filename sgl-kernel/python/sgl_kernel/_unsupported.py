"""Names upstream imports from sgl_kernel that the portable kernels do not implement.

Each such name is a callable that raises ``NotImplementedError`` naming the op,
so an import never fails but a call on an unsupported path is loud.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class UnsupportedOpError(NotImplementedError):
    """Raised when code calls an sgl_kernel op that has no portable implementation."""


def unsupported(qualname: str) -> Callable:
    def op(*args, **kwargs):
        raise UnsupportedOpError(
            f"sgl_kernel op '{qualname}' is not implemented by the portable CPU kernels "
            "of sglang-memx (it needs CUDA). Use a model / configuration on the "
            "documented CPU path (docs/cpu-backend.md), or install upstream sglang-kernel "
            "on a CUDA host."
        )

    name = qualname.rsplit(".", 1)[-1]
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Not available in the portable kernels: {qualname}."
    op.memx_unsupported = True
    return op


def define_unsupported(namespace: dict, module: str, names: Iterable[str]) -> None:
    """Bind every name in ``names`` that ``namespace`` lacks to an unsupported op."""
    for name in names:
        if name not in namespace:
            namespace[name] = unsupported(f"{module}.{name}")
