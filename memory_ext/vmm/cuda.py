"""CUDA (device memory) backend of the virtual-memory layer, on the CUDA driver API.

Uses ``cuda.bindings.driver`` (cuda-python). The binding is imported lazily in
``CudaVmmBackend.__init__``, so importing this module (or ``memory_ext.vmm``)
never needs a driver or a GPU. ``cuda_available()`` answers, without raising,
whether a backend could be built here.

Call by call (``g`` is the granularity, ``dev`` the device ordinal):

* constructor -> ``cuInit(0)``, ``cuDeviceGet(dev)``,
  ``cuDevicePrimaryCtxRetain`` (the same context the CUDA runtime and torch
  use), ``cuMemGetAllocationGranularity(prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)``
  where ``prop`` = pinned device memory on ``dev`` with
  ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` requested. A user granularity
  must be a positive multiple of that minimum.
* every primitive first makes the primary context current on the calling
  thread with ``cuCtxSetCurrent`` (contexts are per thread).
* reserve  -> ``cuMemAddressReserve(size, alignment=g, 0, 0)`` when ``g`` is a
  power of two; otherwise ``size + g`` bytes at the minimum alignment, and the
  range is the first ``g``-aligned ``size`` bytes of it.
* release  -> ``cuMemAddressFree`` of the whole reservation.
* create   -> ``cuMemCreate(g, prop, 0)``; destroy -> ``cuMemRelease``.
* map      -> ``cuMemMap(addr, g, 0, handle, 0)`` then ``cuMemSetAccess(addr, g,
  [read/write for dev])``; if the access call fails the slot is unmapped again.
* unmap    -> ``cuCtxSynchronize`` (unless ``sync_on_unmap=False``) then
  ``cuMemUnmap(addr, g)``; the slot returns to a plain reservation.
* export   -> ``cuMemExportToShareableHandle(handle, POSIX_FILE_DESCRIPTOR, 0)``:
  a new fd (made non-inheritable) that the caller owns.
* import   -> ``cuMemImportFromShareableHandle(fd, POSIX_FILE_DESCRIPTOR)``; the
  fd stays the caller's (the driver does not keep it), and every import is paired
  with its own ``cuMemRelease`` on destroy. The driver cannot report the size of
  an imported allocation; a chunk of the wrong size fails at ``cuMemMap``.
* close    -> the base class's unmap/release/destroy of everything, then
  ``cuDevicePrimaryCtxRelease``.

Every ``CUresult`` is checked; a failure raises ``CudaDriverError`` (an
``OSError``) whose message names the driver call and the error name, e.g.
``cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)``.

Tensor views and their lifetime
-------------------------------
``_make_tensor`` hands torch a small ``_DeviceSpan`` object exposing
``__cuda_array_interface__`` (version 3, ``|u1`` bytes, no stream) through
``torch.as_tensor``; no byte is copied and torch does not own the memory. The
span is kept alive as an attribute of the returned tensor, but it owns nothing
either: it only describes an address. The bytes stay valid exactly as long as
the slot stays mapped (the base class's rule): after ``unmap`` of a slot under
a view, or ``release``/``close``, any use of the view is an illegal-address
fault on the GPU. Before an unmap, work queued on *any* stream that touches the
slot must have finished; ``sync_on_unmap=True`` (the default) makes ``unmap``
call ``cuCtxSynchronize`` first so that the common case is safe.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .base import VmmBackend


class CudaDriverError(OSError):
    """A CUDA driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, call: str, result: Any, name: str):
        self.call = call
        self.result = result
        self.error_name = name
        super().__init__(f"{call} failed: {name} ({int(result)})")


def _load_driver():
    try:
        from cuda.bindings import driver
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise OSError(f"cuda.bindings.driver is not importable (install cuda-python): {exc}") from exc
    return driver


def _error_name(driver, result) -> str:
    try:
        err, name = driver.cuGetErrorName(result)
        if err == driver.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return getattr(result, "name", str(result))


def _call(driver, call: str, fn, *args):
    """Run a driver binding, check its CUresult, return the outputs (None, one, or a tuple)."""
    try:
        out = fn(*args)
    except Exception as exc:
        # e.g. the driver library cannot be loaded: the binding raises, no CUresult
        raise OSError(f"{call} failed: {type(exc).__name__}: {exc}") from exc
    result, rest = out[0], out[1:]
    if result != driver.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, result, _error_name(driver, result))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class _DeviceSpan:
    """Describes ``nbytes`` device bytes at ``address`` to torch; owns nothing."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
            "stream": None,  # nothing pending: no synchronisation needed
        }


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class CudaVmmBackend(VmmBackend):
    """Virtual-memory backend over CUDA device memory (cuMem* driver API)."""

    def __init__(self, device: int = 0, granularity: int | None = None, *, sync_on_unmap: bool = True):
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"device must be a CUDA device, got {device}")
            device = 0 if device.index is None else device.index
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be a non-negative int, got {device!r}")
        d = _load_driver()
        self._drv = d
        _call(d, "cuInit", d.cuInit, 0)
        count = _call(d, "cuDeviceGetCount", d.cuDeviceGetCount)
        if device >= count:
            raise ValueError(f"device {device} does not exist ({count} CUDA device(s))")
        self._dev = _call(d, f"cuDeviceGet({device})", d.cuDeviceGet, device)
        self._ctx = _call(d, "cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain, self._dev)
        self._ctx_retained = True
        try:
            _call(d, "cuCtxSetCurrent", d.cuCtxSetCurrent, self._ctx)
            prop = d.CUmemAllocationProp()
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device
            minimum = int(
                _call(
                    d,
                    "cuMemGetAllocationGranularity",
                    d.cuMemGetAllocationGranularity,
                    prop,
                    d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            )
            if granularity is None:
                granularity = minimum
            if isinstance(granularity, bool) or not isinstance(granularity, int):
                raise TypeError(f"granularity must be an int, got {type(granularity).__name__}")
            if granularity <= 0 or granularity % minimum:
                raise ValueError(
                    f"granularity {granularity} is not a positive multiple of the device's minimum "
                    f"allocation granularity {minimum}"
                )
            super().__init__(granularity)
        except BaseException:
            self._release_ctx()
            raise
        self.device = torch.device("cuda", device)
        self.device_index = device
        self.min_granularity = minimum
        self.sync_on_unmap = bool(sync_on_unmap)
        self._prop = prop
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        # aligned base -> (driver pointer, driver size) for over-reserved ranges
        self._raw: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------ helpers
    def _current(self) -> None:
        _call(self._drv, "cuCtxSetCurrent", self._drv.cuCtxSetCurrent, self._ctx)

    def _release_ctx(self) -> None:
        if getattr(self, "_ctx_retained", False):
            self._ctx_retained = False
            _call(self._drv, "cuDevicePrimaryCtxRelease", self._drv.cuDevicePrimaryCtxRelease, self._dev)

    # ------------------------------------------------------------ primitives
    def _os_reserve(self, size: int) -> int:
        d, g = self._drv, self._granularity
        self._current()
        if _is_pow2(g):
            ptr = _call(d, "cuMemAddressReserve", d.cuMemAddressReserve, size, g, 0, 0)
            return int(ptr)
        raw_size = size + g
        ptr = int(_call(d, "cuMemAddressReserve", d.cuMemAddressReserve, raw_size, self.min_granularity, 0, 0))
        base = -(-ptr // g) * g
        self._raw[base] = (ptr, raw_size)
        return base

    def _os_release(self, base: int, size: int) -> None:
        d = self._drv
        self._current()
        ptr, raw_size = self._raw.get(base, (base, size))
        _call(d, "cuMemAddressFree", d.cuMemAddressFree, ptr, raw_size)
        self._raw.pop(base, None)

    def _os_create(self) -> Any:
        d = self._drv
        self._current()
        return _call(d, "cuMemCreate", d.cuMemCreate, self._granularity, self._prop, 0)

    def _os_destroy(self, handle: Any) -> None:
        d = self._drv
        self._current()
        _call(d, "cuMemRelease", d.cuMemRelease, handle)

    def _os_map(self, address: int, handle: Any) -> None:
        d, g = self._drv, self._granularity
        self._current()
        _call(d, "cuMemMap", d.cuMemMap, address, g, 0, handle, 0)
        try:
            _call(d, "cuMemSetAccess", d.cuMemSetAccess, address, g, self._access, 1)
        except BaseException:
            d.cuMemUnmap(address, g)  # best effort; the access error is the one to report
            raise

    def _os_unmap(self, address: int) -> None:
        d = self._drv
        self._current()
        if self.sync_on_unmap:
            _call(d, "cuCtxSynchronize", d.cuCtxSynchronize)
        _call(d, "cuMemUnmap", d.cuMemUnmap, address, self._granularity)

    def _os_export(self, handle: Any) -> int:
        d = self._drv
        self._current()
        fd = int(_call(d, "cuMemExportToShareableHandle", d.cuMemExportToShareableHandle, handle, self._fd_type, 0))
        try:
            os.set_inheritable(fd, False)
        except OSError:
            os.close(fd)
            raise
        return fd

    def _os_import(self, fd: int, size: int) -> Any:
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ValueError(f"fds: fd {fd} is not an open file descriptor ({exc.strerror})") from None
        d = self._drv
        self._current()
        return _call(d, "cuMemImportFromShareableHandle", d.cuMemImportFromShareableHandle, fd, self._fd_type)

    def _make_tensor(self, address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        span = _DeviceSpan(address, nbytes)
        with torch.cuda.device(self.device):
            raw = torch.as_tensor(span, device=self.device)
        if raw.device != self.device or raw.data_ptr() != address or raw.numel() != nbytes:
            raise RuntimeError(
                f"torch.as_tensor made a copy or a wrong view of {nbytes} bytes at {address:#x} "
                f"({raw.device}, {raw.data_ptr():#x}, {raw.numel()})"
            )
        tensor = raw if dtype == torch.uint8 else raw.view(dtype)
        tensor._memx_cuda_span = span  # describes the address only; see the lifetime rule
        return tensor

    # --------------------------------------------------------------- cleanup
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._current()
            super().close()
            self._release_ctx()


def cuda_available(device: int = 0) -> bool:
    """True when the CUDA driver loads, initialises and has ``device``. Never raises."""
    try:
        d = _load_driver()
        if d.cuInit(0)[0] != d.CUresult.CUDA_SUCCESS:
            return False
        err, count = d.cuDeviceGetCount()
        return err == d.CUresult.CUDA_SUCCESS and 0 <= device < count
    except Exception:
        return False


def cuda_backend(device: int = 0, granularity: int | None = None, **kwargs) -> CudaVmmBackend:
    """A new CUDA device-memory backend (cuMemCreate chunks mapped into cuMemAddressReserve ranges)."""
    return CudaVmmBackend(device, granularity, **kwargs)
