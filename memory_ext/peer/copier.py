"""How a block's bytes move between the borrower's KV and a donor's mapped chunks.

``copy(dst, src)`` enqueues the copy; ``fence(dst, src)`` returns only when it is complete,
so a generation read after the fence sees the state *after* every byte was read (``link``).

``copy_rows(dst, src, rows)`` copies rows ``rows`` (an int64 index, dim 0) of ``src`` into the same
rows of ``dst``: the layer stream cache's gather from / scatter to a layer plane (``lsc``).

* ``HostCopier``: host backend; ``Tensor.copy_`` is synchronous (a memcpy), ``fence`` is a no-op.
* ``CudaPeerCopier``: CUDA backend. The donor's chunks are exported as POSIX fds
  (``cuMemExportToShareableHandle``, the VMM API's IPC handle) and imported by the borrower into a
  ``CudaVmmBackend`` of the *donor's* device, so the view lives on the donor's GPU and
  ``copy_`` between it and the borrower's KV (another GPU) is a device-to-device peer copy
  (NVLink / PCIe P2P when the devices have peer access; torch stages otherwise). ``fence``
  synchronises both devices' current streams.
"""

from __future__ import annotations

import torch


class HostCopier:
    kind = "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fence(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        return None

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        dst.index_copy_(0, rows, src.index_select(0, rows))


class CudaPeerCopier:
    kind = "cuda"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        """Gather on the source's device, one peer copy of the gathered rows, scatter on the destination's."""
        picked = src.index_select(0, rows.to(src.device, non_blocking=True))
        if picked.device != dst.device:
            picked = picked.to(dst.device, non_blocking=True)
        dst.index_copy_(0, rows.to(dst.device, non_blocking=True), picked)

    def fence(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for t in (dst, src):
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()


def copier_for(device: torch.device):
    """The copier for a backend whose views live on ``device``."""
    return CudaPeerCopier() if device.type == "cuda" else HostCopier()
