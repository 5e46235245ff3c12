"""Virtual-memory layer: reserve address ranges, back their slots with physical
chunks, alias chunks, view mapped bytes as tensors, pass chunks between processes.

    from memory_ext.vmm import host_backend
    vmm = host_backend(granularity=1 << 21)
    r = vmm.reserve(1 << 30)
    c = vmm.create_chunk()
    vmm.map(r, 0, c)
    t = vmm.tensor_view(r, 0, (1024,), torch.float16)

See ``base`` for the model and invariants, ``host`` for the host backend,
``ipc`` for sending chunks over Unix sockets, and docs/memory-pool.md.
"""

from .base import COUNTER_NAMES, PhysicalChunk, VirtualRange, VmmBackend
from .host import DEFAULT_GRANULARITY, HostVmmBackend
from .ipc import (
    ReceivedChunk,
    UnsafeDirectoryError,
    check_private_dir,
    connect_unix,
    listen_unix,
    private_dir,
    recv_chunks,
    send_chunks,
)

_LAZY = {"CudaVmmBackend", "cuda_available", "cuda_backend"}  # from .cuda, which imports torch


def __getattr__(name: str):
    """The CUDA names load on first use, so a process that only passes chunks around (the
    pool arbiter) starts without importing torch."""
    if name in _LAZY:
        from . import cuda

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def host_backend(granularity: int = DEFAULT_GRANULARITY, **kwargs) -> HostVmmBackend:
    """A new host-memory backend (memfd chunks mapped over a PROT_NONE reservation)."""
    return HostVmmBackend(granularity, **kwargs)


__all__ = [
    "COUNTER_NAMES",
    "CudaVmmBackend",
    "DEFAULT_GRANULARITY",
    "HostVmmBackend",
    "PhysicalChunk",
    "ReceivedChunk",
    "UnsafeDirectoryError",
    "VirtualRange",
    "VmmBackend",
    "check_private_dir",
    "connect_unix",
    "cuda_available",
    "cuda_backend",
    "host_backend",
    "listen_unix",
    "private_dir",
    "recv_chunks",
    "send_chunks",
]
