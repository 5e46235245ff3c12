"""Custom all-reduce (CUDA IPC / ROCm quick-reduce) entry points.

Upstream only calls these when it runs on CUDA, ROCm or MUSA; on a CPU host it
imports the module and leaves it unused. Every entry point is unsupported.
"""

from __future__ import annotations

from sgl_kernel._unsupported import define_unsupported

UNSUPPORTED = (
    "init_custom_ar",
    "all_reduce",
    "all_reduce_reg",
    "all_reduce_unreg",
    "deterministic_all_reduce_reg",
    "deterministic_all_reduce_unreg",
    "dispose",
    "meta_size",
    "register_buffer",
    "get_graph_buffer_ipc_meta",
    "register_graph_buffers",
    "allocate_meta_buffer",
    "get_meta_buffer_ipc_handle",
    "init_custom_qr",
    "qr_get_handle",
    "qr_open_handles",
    "qr_all_reduce",
    "qr_destroy",
    "qr_max_size",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ = list(UNSUPPORTED)
