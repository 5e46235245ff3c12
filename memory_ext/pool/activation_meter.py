"""Measure the peak bytes of tensors a piece of code allocates (activations of one forward).

``PeakMeter`` is a context manager. On CUDA it reads the caching allocator's
statistics (``max_memory_allocated`` above what was allocated on entry). On
the host, where torch keeps no allocator statistics, it watches every op
through a ``TorchDispatchMode``: a tensor an op returns whose storage is not
one of the op's inputs is a new allocation; its bytes count as live until
the last tensor seen on that storage is collected. ``peak_bytes`` is the
most that was live at once. Invariants: only storages created inside the
block are counted (weights, KV buffers and other inputs never are); views
and in-place results add nothing.

The host meter slows the block down (a Python call per op); measure a few
forwards, not every one.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _HostAllocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors seen on it]

    def _forget(self, ptr: int) -> None:
        entry = self._held.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            self.live -= entry[0]
            del self._held[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in inputs:
                continue
            entry = self._held.get(ptr)
            if entry is None:
                self._held[ptr] = [storage.nbytes(), 1]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            else:
                entry[1] += 1
            weakref.finalize(t, self._forget, ptr)
        return out


class PeakMeter:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._mode = None
        self._base = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _HostAllocations()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
