"""Our CUDA backend on the fake driver: ``installed`` puts a ``FakeDriver`` in ``sys.modules`` as
``cuda.bindings.driver``; ``FakeCudaVmmBackend`` is ``CudaVmmBackend`` built through it.

Every ``_os_*`` primitive of ``memory_ext.vmm.cuda`` runs unchanged. Only ``_make_tensor``
differs, because no tensor can live on a device here: it asks the fake whether the device may
touch the mapped bytes (``check_access``: access set; holes of bare reservation are allowed, as
``LayeredKVBuffers.view`` spans them) and returns a CPU tensor over the same addresses. The
check is made when the view is made; touching a hole or memory unmapped later is a SIGSEGV,
as on the host backend. So ``device`` is ``cpu`` (peer links and weight stores pick their host copiers) and
``cuda_device`` is what the real backend would report.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import torch

from memory_ext.vmm.cuda import CudaVmmBackend

from .fake_cuda_driver import FakeDriver

_NAMES = ("cuda", "cuda.bindings", "cuda.bindings.driver")


@contextlib.contextmanager
def installed(driver: FakeDriver):
    """``from cuda.bindings import driver`` yields ``driver`` inside the block; restored after."""
    saved = {n: sys.modules.get(n) for n in _NAMES}
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    cuda.__path__ = bindings.__path__ = []
    cuda.bindings, bindings.driver = bindings, driver
    sys.modules.update(zip(_NAMES, (cuda, bindings, driver)))
    try:
        yield driver
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class FakeCudaVmmBackend(CudaVmmBackend):
    """``CudaVmmBackend`` on a ``FakeDriver``; views are CPU tensors checked against the fake."""

    def __init__(self, driver: FakeDriver, device: int = 0, granularity: int | None = None, **kwargs):
        with installed(driver):
            super().__init__(device, granularity, **kwargs)
        self.cuda_device = self.device
        self.device = torch.device("cpu")

    def _make_tensor(self, address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        self._drv.check_access(address, nbytes, self.device_index, holes=True)
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)


def fake_cuda_backend(
    granularity: int | None = None, *, min_granularity: int = 1 << 16, driver: FakeDriver | None = None, **kwargs
) -> FakeCudaVmmBackend:
    """A backend on a new fake driver (64 KiB minimum granularity keeps host runs light) or on ``driver``."""
    drv = driver if driver is not None else FakeDriver(min_granularity=min_granularity)
    return FakeCudaVmmBackend(drv, 0, granularity, **kwargs)
